"""The compiled HTTP/2 server core: :class:`NativeH2ServerCore`, the interface of
:class:`~zerolayer.runtime.protocol.h2conn.H2ServerCore` with the protocol work done by hyper's Rust
``h2`` crate (a PyO3 extension, ``native/h2core``), driven sans-IO.

Same constructor (``gate, limits=None, *, on_limit, clock, budget``), methods, attributes and
events (the dataclasses of :mod:`zerolayer.runtime.protocol.events`, built by the extension). Every
frame and request is handled in Rust: the frame scanner that enforces the hardening limits, h2, the
gate bookkeeping, body buffering and outbound flow control. Where it differs from the Python core,
and why, is in ``docs/server-core.md`` ("The native core"); the differences in short:

* GOAWAYs the core ends a connection with (limits, drain, :meth:`close`, header timeout) are written
  by the extension after h2's pending output, naming the same last stream as the Python core (the
  highest stream taken when a drain began, else the highest inbound stream); protocol errors h2
  detects are answered by h2's own GOAWAY;
* a chunk of bytes that trips a limit is not handed to h2 at all (python-hyper drops that chunk's
  events too); the rapid-reset budget is taken per RST_STREAM frame, also before h2 sees it;
* a header block whose *compressed* size exceeds ``max_header_list_size`` ends the connection
  (ENHANCE_YOUR_CALM); a smaller block that decodes larger is answered 431 and REFUSED_STREAM by h2
  on that stream alone;
* h2's own CONTINUATION limit (max(5, 1.25 x max_header_list_size / max_frame_size) frames) may end
  a connection before ``max_continuation_frames``, also with ENHANCE_YOUR_CALM; so may h2's lifetime
  cap of 100 empty non-final DATA frames;
* a malformed request (e.g. a body that disagrees with its content-length) is a stream error
  (RST_STREAM PROTOCOL_ERROR, RFC 9113 §8.1.1), where python-hyper ends the connection;
* within one ``receive`` the events are the same set, new streams gated first, then by stream id;
* a stream the core forgets while h2 still has it open (a failed ``send_head``) is reset by h2
  (CANCEL) instead of being left open.

Server PINGs are written by the extension too (h2's ``PingPong`` allows one in flight), and a
WINDOW_UPDATE overflow on a stream whose response has ended, which h2 ignores, is answered
RST_STREAM(FLOW_CONTROL_ERROR) as python-hyper does (h2spec 6.9.1/3).
"""

from __future__ import annotations

try:
    from zerolayer_h2core import H2Core as _H2Core
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "the native HTTP/2 core is not built: run `python3 -m pip install ./native/h2core` "
        f"from the repository root ({exc})") from exc

__all__ = ["NativeH2ServerCore"]


class NativeH2ServerCore(_H2Core):
    """One server-side HTTP/2 connection, sans I/O, on the Rust ``h2`` crate.

    ``gate(head)`` is called once per request when its header block is complete and must not block
    (no borrow of the core is held while it runs). ``on_limit(name)`` is called each time a
    hardening limit trips.
    """

    http_version = "2"
