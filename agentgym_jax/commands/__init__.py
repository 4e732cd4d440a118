"""The commands, one module each: absl flags at module level and a `main()` that runs the
command through agentgym_jax.cli (one-line errors, --help). They are the package's console
scripts (agentgym-train, agentgym-eval, agentgym-generate, agentgym-serve-env,
agentgym-serve-policy, agentgym-demos, agentgym-view, agentgym-plot, agentgym-plan); launch/*.py
run the same from a checkout.

A process imports one command: two commands define flags of the same name."""
