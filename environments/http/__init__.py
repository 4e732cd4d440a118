"""The AgentGym HTTP protocol: a server for any registered adapter and a client adapter.

The client is registered as environment "http":
  environments.make("http", base_url="http://127.0.0.1:36001", env="textcraft")
"""

from environments.http.client import AgentGymClient
from environments.http.protocol import STYLES, PayloadStyle, extract_action, style_for
from environments.http.server import AgentGymServer

__all__ = [
    "AgentGymClient", "AgentGymServer", "PayloadStyle", "STYLES", "extract_action", "style_for"
]
