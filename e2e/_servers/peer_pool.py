"""The connection pool of every data-path client in the reference deployment.

httpx caps a client at 100 connections by default. A reference server's client to its peer carries
one request per rollout in flight (an episode's activation, an agent's model call, a model call on
its worker), and a request waiting for a pooled connection is neither running nor refused: with
hundreds of rollouts in flight a checkpoint would find episodes stuck before their first boundary
until the pool freed up, which only happens after the resume. So data-path clients have no
connection cap; the descriptor limit of the process is the real bound, and the drill and the
benches say what they need. Control-path clients keep their small reserved pools (D112).
"""

from __future__ import annotations

from typing import Final

import httpx

# Idle pooled connections are dropped after IDLE_CONNECTION_EXPIRY_S, before a server's
# keep-alive closes them (the race below): every client of the reference deployment and the
# coordinator's own use the one figure (D371).
from coordinator import IDLE_CONNECTION_EXPIRY_S, http_transport

SERVER_KEEP_ALIVE_S: Final = 30
"""How long a reference server keeps an idle connection open (uvicorn's default is 5 s). A client
drops its idle connections after ``IDLE_CONNECTION_EXPIRY_S``, but a process whose event loop is
starved may send a request seconds after it took the connection from its pool: at 2,000 rollouts in
flight on two cores, two episodes ended in ``ReadError('')`` with a 5 s keep-alive (D374)."""

PEER_POOL: Final = httpx.Limits(
    max_connections=None, max_keepalive_connections=512, keepalive_expiry=IDLE_CONNECTION_EXPIRY_S
)
"""No cap on connections; 512 idle ones are kept for reuse, each for at most 2 s. uvicorn closes
a connection idle for 5 s; with httpx's default of 5 s too, a client sometimes sent its request
down a connection the server was closing and read nothing back (``ReadError('')``: 4 rollouts of
1,000 in the first ``drill --rollouts 1000 --workers 2``). Expiring idle connections well before
the server does removes that race. With thousands in flight, replies come back in bursts of
hundreds: keeping 64 idle ones closed most of a burst, and the next burst opened them again
(D385)."""

CONTROLLER_POOL: Final = httpx.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=IDLE_CONNECTION_EXPIRY_S
)
"""A controller's own reads (a rollout's ledger manifest after its result, a server's status):
httpx's default caps, with idle connections expiring as the data path's do. With httpx's default
of 5 s, the drill's controller once died of ``RemoteProtocolError`` on a manifest read, 30 s into
a baseline of 2,000 rollouts in flight (D371)."""


CONNECT_RETRIES: Final = 5
"""How many more times a data-path client tries to open a connection that could not be made."""
CONNECT_SECONDS: Final = 60.0
"""How long a data-path connect may take before it is given up, where the call has no shorter
deadline of its own (D409). On 127.0.0.1 a connect that has not completed is one the client's
event loop has not processed yet, or a SYN the kernel is still sending again. At 4,000 rollouts in
flight the loops stalled for up to 12 s, and a 10 s connect timeout then gave up connections
the kernel had made. The server had accepted each of them, and each was tried again: more work
for loops that were already behind."""
HELD_CALL_TIMEOUT: Final = httpx.Timeout(connect=CONNECT_SECONDS, read=900.0, write=60.0, pool=60.0)
"""Every data-path call that may be held through a checkpoint on its way back (an agent's model
and tool calls, the policy server's calls to its worker, a shard's proxy): a long read, and a
connect as long as every data-path connect (D409)."""


def peer_transport() -> httpx.AsyncHTTPTransport:
    """The transport of every data-path client: ``PEER_POOL``, and a connection that could not be
    made (refused, or no answer to the SYN within the connect timeout) tried again up to
    ``CONNECT_RETRIES`` more times, after 0, 0.5, 1, 2 and 4 s (httpcore's backoff).

    Nothing of the request was sent when a connection fails, so nothing can run twice. A
    connection refused (a peer restarting) is worth trying again. A connect that takes long is
    not: it is given ``CONNECT_SECONDS`` or its call's budget (D409), so a try is given up only
    when the call is out of time anyway. Each call's own deadline still bounds all of it.
    """
    return http_transport(PEER_POOL, retries=CONNECT_RETRIES)
