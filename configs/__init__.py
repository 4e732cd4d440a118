"""The experiment configs, shipped in the package as agentgym_jax.configs: each file's
get_config(variant) builds one run (docs in its docstring)."""
