"""Two tiny web sites for the WebArena tests, each on its own loopback port.

The shop (WebArena's __SHOPPING__): a product list with a search box, product pages with a
price and an add-to-cart form, and a cart. The forum (__REDDIT__): a list of posts, post pages
with replies, a reply form and an author card that appears on hover.

Visitors are told apart by a session cookie and each sees only its own cart and replies, so
every episode (a new browser context) starts from the same sites, as WebArena's sites are reset
between tasks. The tasks over these sites are in config_files/, in WebArena's format.
"""

from __future__ import annotations

import contextlib
import html
import http.server
import pathlib
import re
import threading
import urllib.parse
import uuid
from typing import Iterator

CONFIG_DIR = pathlib.Path(__file__).parent / "config_files"

# slug, name, price. Long enough that the last products are below a 720-pixel window.
PRODUCTS = (
    ("blue-kettle", "Blue Kettle", "24.99"),
    ("ceramic-mug", "Ceramic Mug", "8.50"),
    ("travel-mug", "Travel Mug", "15.00"),
    ("cast-iron-pan", "Cast Iron Pan", "39.95"),
    ("bread-knife", "Bread Knife", "18.20"),
    ("salad-bowl", "Salad Bowl", "21.00"),
    ("pepper-mill", "Pepper Mill", "12.75"),
    ("oven-mitts", "Oven Mitts", "9.99"),
    ("cutting-board", "Cutting Board", "27.40"),
    ("measuring-cups", "Measuring Cups", "11.10"),
    ("whisk", "Whisk", "6.25"),
    ("colander", "Colander", "14.60"),
    ("rolling-pin", "Rolling Pin", "13.30"),
    ("spice-rack", "Spice Rack", "32.00"),
    ("tea-infuser", "Tea Infuser", "7.80"),
    ("egg-timer", "Egg Timer", "5.50"),
    ("butter-dish", "Butter Dish", "16.45"),
    ("soup-ladle", "Soup Ladle", "8.05"),
    ("grater", "Grater", "10.90"),
    ("apron", "Apron", "19.00"),
    ("napkin-rings", "Napkin Rings", "12.00"),
    ("water-jug", "Water Jug", "22.15"),
    ("cake-tin", "Cake Tin", "17.35"),
    ("tea-towel-set", "Tea Towel Set", "12.00"),
)
PRICES = {slug: (name, price) for slug, name, price in PRODUCTS}

# id: (title, author, body, replies as (author, text))
POSTS = {
    1: ("Best hiking trails near town", "alice", "Which trails do you like in spring?",
        (("dave", "The ridge loop, without a doubt."),)),
    2: ("Weekend meetup at the park", "bob", "Picnic on Saturday at noon by the fountain.",
        (("erin", "I will bring lemonade."),)),
    3: ("Which kettle should I buy?", "carol", "Mine broke after ten years.", ()),
}
KARMA = {"alice": 120, "bob": 87, "carol": 45}

_STYLE = "li { padding: 8px 0; } body { font-family: sans-serif; }"


def _page(title: str, nav: str, body: str) -> bytes:
  return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
          f"</title><style>{_STYLE}</style></head><body><nav>{nav}</nav><main>{body}</main>"
          "</body></html>").encode()


class _Handler(http.server.BaseHTTPRequestHandler):
  """Routes, a session cookie and HTML answers; subclasses are the two sites."""

  cookie_name = ""
  sessions: dict[str, dict]

  def log_message(self, *args) -> None:  # Keep test output quiet.
    pass

  def do_GET(self) -> None:
    url = urllib.parse.urlsplit(self.path)
    self._dispatch("GET", url.path.rstrip("/") or "/", urllib.parse.parse_qs(url.query))

  def do_POST(self) -> None:
    length = int(self.headers.get("Content-Length", 0))
    form = urllib.parse.parse_qs(self.rfile.read(length).decode())
    self._dispatch("POST", self.path.rstrip("/") or "/", form)

  def _dispatch(self, method: str, path: str, params: dict[str, list[str]]) -> None:
    self._state = self._session()
    for pattern, handler in self.routes():
      match = re.fullmatch(pattern, f"{method} {path}")
      if match:
        handler(*match.groups(), params)
        return
    self._send(404, _page("Not found", "", "<h1>Page not found</h1>"))

  def routes(self) -> list:
    raise NotImplementedError

  def _session(self) -> dict:
    cookies = dict(part.strip().split("=", 1) for part in self.headers.get("Cookie", "").split(";")
                   if "=" in part)
    self._new_sid = None
    sid = cookies.get(self.cookie_name)
    if sid not in self.sessions:
      sid = self._new_sid = uuid.uuid4().hex
      self.sessions[sid] = {}
    return self.sessions[sid]

  def _send(self, status: int, body: bytes, location: str | None = None) -> None:
    self.send_response(status)
    if self._new_sid:
      self.send_header("Set-Cookie", f"{self.cookie_name}={self._new_sid}; Path=/")
    if location:
      self.send_header("Location", location)
    self.send_header("Content-Type", "text/html; charset=utf-8")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)


class _Shop(_Handler):
  cookie_name = "shop_session"
  _NAV = "<a href='/'>One Stop Shop</a> | <a href='/cart'>Cart</a>"

  def routes(self) -> list:
    return [(r"GET /", self._home), (r"GET /search", self._search),
            (r"GET /product/([a-z-]+)", self._product), (r"POST /cart/add", self._add),
            (r"GET /cart", self._cart)]

  def _list(self, products) -> str:
    items = "".join(f"<li><a href='/product/{slug}'>{name}</a> <span>${price}</span></li>"
                    for slug, name, price in products)
    return f"<ul id='products'>{items}</ul>"

  def _home(self, params) -> None:
    search = ("<form role='search' action='/search' method='get'><input type='search' name='q' "
              "aria-label='Search products'><button type='submit'>Search</button></form>")
    self._send(
        200,
        _page("One Stop Shop", self._NAV, f"<h1>One Stop Shop</h1>{search}{self._list(PRODUCTS)}"))

  def _search(self, params) -> None:
    query = params.get("q", [""])[0].strip()
    found = [p for p in PRODUCTS if query and query.lower() in p[1].lower()]
    listing = self._list(found) if found else "<p>No products found.</p>"
    title = f"Search results for '{query}'"
    self._send(200, _page(title, self._NAV, f"<h1>{html.escape(title)}</h1>{listing}"))

  def _product(self, slug, params) -> None:
    if slug not in PRICES:
      self._send(404, _page("Not found", self._NAV, "<h1>No such product</h1>"))
      return
    name, price = PRICES[slug]
    form = (f"<form method='post' action='/cart/add'><input type='hidden' name='item' "
            f"value='{slug}'><label>Quantity <input type='text' name='qty' placeholder='1' "
            "size='3'></label> <button type='submit'>Add to Cart</button></form>")
    self._send(
        200,
        _page(name, self._NAV, f"<h1>{name}</h1><p>Price: <span id='price'>"
              f"${price}</span></p>{form}"))

  def _add(self, params) -> None:
    slug = params.get("item", [""])[0]
    quantity = params.get("qty", ["1"])[0].strip() or "1"
    if slug not in PRICES or not quantity.isdigit() or int(quantity) < 1:
      self._send(400, _page("Invalid order", self._NAV, "<h1>Invalid quantity</h1>"))
      return
    cart = self._state.setdefault("cart", {})
    cart[slug] = cart.get(slug, 0) + int(quantity)
    self._send(303, b"", location="/cart")

  def _cart(self, params) -> None:
    cart = self._state.get("cart", {})
    rows = "".join(f"<tr data-item='{slug}'><td class='name'>{PRICES[slug][0]}</td>"
                   f"<td class='qty'>{count}</td></tr>" for slug, count in cart.items())
    body = (f"<table id='cart'><tr><th>Product</th><th>Quantity</th></tr>{rows}</table>"
            if cart else "<p>Your cart is empty.</p>")
    self._send(200, _page("Shopping Cart", self._NAV, f"<h1>Shopping Cart</h1>{body}"))


class _Forum(_Handler):
  cookie_name = "forum_session"
  _NAV = "<a href='/'>Forums</a>"

  def routes(self) -> list:
    return [(r"GET /", self._home), (r"GET /post/(\d+)", self._post),
            (r"POST /post/(\d+)/reply", self._reply)]

  def _replies(self, post_id: int) -> list[tuple[str, str]]:
    return list(POSTS[post_id][3]) + self._state.get("replies", {}).get(post_id, [])

  def _home(self, params) -> None:
    items = "".join(f"<li><a href='/post/{i}'>{title}</a> by {author}, "
                    f"{len(self._replies(i))} replies</li>"
                    for i, (title, author, _, _) in POSTS.items())
    self._send(200, _page("Forums", self._NAV, f"<h1>Forums</h1><ul id='posts'>{items}</ul>"))

  def _post(self, post_id, params) -> None:
    post_id = int(post_id)
    if post_id not in POSTS:
      self._send(404, _page("Not found", self._NAV, "<h1>No such post</h1>"))
      return
    title, author, body, _ = POSTS[post_id]
    byline = (f"<p><span id='author' onmouseenter=\"document.getElementById('author-card')"
              f".hidden = false\">Posted by {author}</span></p><div id='author-card' hidden>"
              f"{author} has {KARMA[author]} karma</div>")
    replies = "".join(f"<article class='reply'><b>{who}</b>: {html.escape(text)}</article>"
                      for who, text in self._replies(post_id))
    form = (f"<form method='post' action='/post/{post_id}/reply'><label>Reply <textarea "
            "name='body'></textarea></label> <button type='submit'>Post reply</button></form>")
    self._send(
        200,
        _page(
            title, self._NAV, f"<h1>{title}</h1>{byline}<p>{body}</p>"
            f"<section id='replies'><h2>Replies</h2>{replies}</section>{form}"))

  def _reply(self, post_id, params) -> None:
    post_id = int(post_id)
    text = params.get("body", [""])[0].strip()
    if post_id in POSTS and text:
      self._state.setdefault("replies", {}).setdefault(post_id, []).append(("you", text))
    self._send(303, b"", location=f"/post/{post_id}")


@contextlib.contextmanager
def serve() -> Iterator[dict[str, str]]:
  """Serves both sites; yields their addresses by WebArena site name."""
  servers = {}
  for name, handler in (("SHOPPING", _Shop), ("REDDIT", _Forum)):
    site = type(handler.__name__, (handler,), {"sessions": {}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), site)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers[name] = server
  try:
    yield {name: f"http://127.0.0.1:{server.server_port}" for name, server in servers.items()}
  finally:
    for server in servers.values():
      server.shutdown()
      server.server_close()
