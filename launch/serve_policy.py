r"""Serves a policy behind OpenAI's chat completions API: the agentgym-serve-policy command from a
checkout.

  python launch/serve_policy.py                                 # SmolLM2-135M-Instruct on :8000
  python launch/serve_policy.py --model=runs/local/export --port=8001

agentgym_jax/commands/serve_policy.py has the flags and says what they do (--help lists them).
"""

from agentgym_jax.commands.serve_policy import main

if __name__ == "__main__":
  main()
