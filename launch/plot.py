r"""Draws a run's training curves as PNG images: the agentgym-plot command from a checkout.

  python launch/plot.py --workdir=/tmp/run [--out_dir=/tmp/run/plots] [--smoothing=0.6]

agentgym_jax/commands/plot.py has the flags and says what they do (--help lists them).
"""

from agentgym_jax.commands.plot import main

if __name__ == "__main__":
  main()
