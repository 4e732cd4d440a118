r"""Chats with a model in the terminal: the agentgym-generate command from a checkout.

  python launch/generate.py --prompt="Name three uses of redstone."   # one reply, then exit
  python launch/generate.py                                           # a chat on stdin
  python launch/generate.py --model=qwen2.5-0.5b-instruct --temperature=0.7 --top_p=0.9

agentgym_jax/commands/generate.py has the flags and says what they do (--help lists them).
"""

from agentgym_jax.commands.generate import main

if __name__ == "__main__":
  main()
