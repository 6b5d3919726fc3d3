"""The job's relay of its engine's KV-cache events: encrypted on the network, and only for the job's secret.

vLLM's event publisher (``--kv-events-config``) has no authentication: anyone who can reach a node could
subscribe and read the token ids of every prompt, and ask the replay socket for the recent ones.  So a
``kv_aware`` job's engine binds both on ``ipc://`` sockets in a folder only the job's user may enter (loopback
ports would be open to other users' jobs on the node), and this relay forwards them to
the ports the endpoint record names, as a ZeroMQ CURVE server whose keys come from the job's secret
(:func:`curve_keys`):

* the events: an XPUB for the network, an XSUB on the engine's PUB (subscriptions one way, events the other);
* the replay: a ROUTER for the network; each asker's requests go to the engine's ROUTER through a DEALER of
  its own, so the engine sees vLLM's framing (``[asker, b"", start_seq]``) and its answers (``[b"", topic,
  seq, payload]`` up to the end marker) go back to that asker only.

The gateway derives the same server key from the secret in the endpoint record; a subscriber without it
cannot complete the handshake, and what passes is encrypted.  The relay runs in the job, inside the
container when there is one (with its ``python3`` and the pyzmq vLLM needs), so it uses nothing but the
standard library and pyzmq: the job writes this file next to itself, as it does the engine's middleware.

    python3 slurmfleet_kv_relay.py ipc://DIR/events tcp://*:PORT ipc://DIR/replay tcp://*:PORT2
    (the secret: VLLM_API_KEY; the engine binds the ipc sockets, the relay connects to them)
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import zmq
from zmq.utils import z85

END_SEQ = (-1).to_bytes(8, "big", signed=True)
IDLE_S = 30.0   # a replay asker's DEALER without a frame this long is closed


def curve_keys(secret: str) -> tuple[bytes, bytes]:
    """The relay's CURVE server keys (public, secret; Z85) made from a job's secret."""
    sk = z85.encode(hashlib.sha256(b"slurmfleet-kv-curve\0" + secret.encode()).digest())
    return zmq.curve_public(sk), sk


def server_key(secret: str) -> bytes:
    """What a client of the relay of the job with this secret must know: its CURVE server (public) key."""
    return curve_keys(secret)[0]


def client_options(sock: zmq.Socket, key: bytes) -> None:
    """Make ``sock`` a CURVE client of the relay whose :func:`server_key` this is (a throwaway key of its own)."""
    mine, my_secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = key, mine, my_secret


def relay(ctx: zmq.Context, events_in: str, events_out: str, replay_in: str, replay_out: str, secret: str,
          stop: zmq.Socket | None = None, idle_s: float = IDLE_S) -> None:
    """Forward until ``stop`` (a socket: any message ends it) or the process ends.  An asker's DEALER goes
    with the end marker of its answer, or after ``idle_s`` without a frame (an answer cut at a high-water
    mark loses its end: the asker asks again, under a new identity)."""
    public, private = curve_keys(secret)

    def server(kind: int, addr: str) -> zmq.Socket:
        s = ctx.socket(kind)
        s.curve_server, s.curve_publickey, s.curve_secretkey = True, public, private
        s.setsockopt(zmq.LINGER, 0)
        s.ipv6 = True   # "*" binds both families (libzmq falls back to IPv4 where the node has no IPv6)
        if kind == zmq.ROUTER:
            s.setsockopt(zmq.SNDHWM, 0)   # a replay answer is long: kept whole (the live events keep the limit)
        s.bind(addr)
        return s

    xpub, router = server(zmq.XPUB, events_out), server(zmq.ROUTER, replay_out)
    xsub = ctx.socket(zmq.XSUB)
    xsub.setsockopt(zmq.LINGER, 0)
    xsub.connect(events_in)
    askers: dict[bytes, zmq.Socket] = {}   # replay asker's identity -> its DEALER to the engine
    owner: dict[zmq.Socket, bytes] = {}
    seen: dict[zmq.Socket, float] = {}     # a DEALER's last frame (monotonic seconds)
    poller = zmq.Poller()
    for s in (xpub, xsub, router) + ((stop,) if stop is not None else ()):
        poller.register(s, zmq.POLLIN)

    def forget(s: zmq.Socket) -> None:
        poller.unregister(s)
        del askers[owner.pop(s)], seen[s]
        s.close(linger=0)
    try:
        while True:
            now = time.monotonic()
            for s in [s for s, t in seen.items() if now - t > idle_s]:
                forget(s)
            for s, _ in poller.poll(1000):
                if s is stop:
                    return
                if s is xpub:
                    xsub.send_multipart(xpub.recv_multipart())    # a (un)subscription
                elif s is xsub:
                    xpub.send_multipart(xsub.recv_multipart())    # an event batch
                elif s is router:
                    frames = router.recv_multipart()
                    dealer = askers.get(frames[0])
                    if dealer is None:
                        dealer = askers[frames[0]] = ctx.socket(zmq.DEALER)
                        dealer.setsockopt(zmq.LINGER, 0)
                        dealer.setsockopt(zmq.RCVHWM, 0)
                        dealer.connect(replay_in)
                        owner[dealer] = frames[0]
                        poller.register(dealer, zmq.POLLIN)
                    seen[dealer] = time.monotonic()
                    dealer.send_multipart(frames[1:])
                else:
                    frames = s.recv_multipart()
                    seen[s] = time.monotonic()
                    router.send_multipart([owner[s], *frames])
                    if len(frames) > 2 and frames[2] == END_SEQ:   # the answer is whole: forget the asker
                        forget(s)
    finally:
        for s in (xpub, xsub, router, *owner):
            s.close(linger=0)


def main(argv: list[str]) -> int:
    if len(argv) != 4 or not os.environ.get("VLLM_API_KEY"):
        print("usage: slurmfleet_kv_relay.py EVENTS_IN EVENTS_OUT REPLAY_IN REPLAY_OUT (with VLLM_API_KEY set)",
              file=sys.stderr)
        return 2
    relay(zmq.Context(), *argv, secret=os.environ["VLLM_API_KEY"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
