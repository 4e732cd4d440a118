r"""Writes one self-contained HTML page for browsing a run: the agentgym-view command from a
checkout.

  python launch/view.py --workdir=/tmp/run [--out=/tmp/run/viewer.html] [--max_steps=20]

agentgym_jax/commands/view.py has the flags and says what they do (--help lists them).
"""

from agentgym_jax.commands.view import main

if __name__ == "__main__":
  main()
