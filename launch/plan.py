r"""Per-device memory of a policy's update step and sampler on a mesh, from abstract arrays: the
agentgym-plan command from a checkout.

  python launch/plan.py --model=qwen2.5-7b-instruct --mesh=1,8,1 --batch=8 --seq=4096

agentgym_jax/commands/plan.py has the flags and says what they do (--help lists them).
"""

from agentgym_jax.commands.plan import main

if __name__ == "__main__":
  main()
