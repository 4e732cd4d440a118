"""A small shop and a small forum served on loopback, with WebArena tasks over them."""

from webarena_site.site import CONFIG_DIR, serve

__all__ = ["CONFIG_DIR", "serve"]
