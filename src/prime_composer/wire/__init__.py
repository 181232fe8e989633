"""What crosses a link between machines, made safe to cross it: signed requests with no reusable
secret on the wire (``auth``), TLS pinned by certificate fingerprint (``tls``), and requests and
fetches with wall-clock deadlines and size caps (``fetch``). DiLoCo's origins and relay and the
weights origin of remote inference workers use them alike."""
