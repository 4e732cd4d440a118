r"""Serves one environment over the AgentGym HTTP protocol: the agentgym-serve-env command from a
checkout.

  python launch/serve_env.py --env=textcraft --port=36001
  python launch/serve_env.py --env=textcraft --option=goals=agentgym   # the original's 544 goals

agentgym_jax/commands/serve_env.py has the flags and says what they do (--help lists them).
"""

from agentgym_jax.commands.serve_env import main

if __name__ == "__main__":
  main()
