//! zerolayer's compiled HTTP/2 server core: the interface of
//! `zerolayer.runtime.protocol.h2conn.H2ServerCore`, with the protocol work done by the Rust `h2`
//! crate (hyper's HTTP/2), driven sans-IO.
//!
//! * An in-memory IO object (`Io`) stands in for the socket: h2 reads the bytes `receive` was given
//!   (`Pending` once they are used up) and writes into an output buffer that `data_to_send` empties.
//!   Every public method polls the connection, each stream's `RecvStream` (data released for flow
//!   control at once) and reset state, and each stream's queued output (sent only as far as h2
//!   assigns send capacity, i.e. the peer's windows), with a no-op waker: no runtime, no threads.
//! * A frame-header scanner looks at every inbound frame before h2 sees it and enforces the same
//!   hardening limits as the Python core's `_inspect` / `_GuardedFrameBuffer`; a chunk of bytes that
//!   trips one is never handed to h2 (as python-hyper's `receive_data` raising drops the events of
//!   its whole chunk), `on_limit(name)` is called and the connection ends with our own
//!   GOAWAY(ENHANCE_YOUR_CALM).
//! * GOAWAYs that end the connection on our initiative (limits, drain, close, timeouts) are written
//!   by this module after h2's pending output, not by h2: h2's `abrupt_shutdown` would name the
//!   highest stream h2 opened, including streams refused while draining; ours names what the Python
//!   core names (the highest stream taken when the drain began, else the highest inbound stream).
//!   GOAWAYs for protocol errors h2 detects are h2's own. Server PINGs are ours too (h2's
//!   `PingPong` allows one in flight; h2 ignores the ACK of a PING it did not send).
//! * h2 ignores WINDOW_UPDATEs on a stream whose send side has closed; an overflow past 2^31-1 there
//!   is answered RST_STREAM(FLOW_CONTROL_ERROR) by this module (RFC 9113 §6.9.1, h2spec 6.9.1/3),
//!   from the peer's initial window, its increments and the DATA bytes we sent on the stream.
//! * The gate, `on_limit`, the clock and the body budget are Python callables; the gate runs with
//!   no borrow of the core held, the others must not call back into the core.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use h2::server::{Builder, Connection, Handshake, SendResponse};
use h2::{PingPong, Reason, RecvStream, SendStream};
use http::{HeaderName, HeaderValue, Response, StatusCode};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const NO_ERROR: u32 = 0x0;
const PROTOCOL_ERROR: u32 = 0x1;
const REFUSED_STREAM: u32 = 0x7;
const CANCEL: u32 = 0x8;
const ENHANCE_YOUR_CALM: u32 = 0xb;
const EARLY_RESET_BODY: u64 = 65536;

// ---------------------------------------------------------------------------------------- python
struct Classes {
    request_head: PyObject,
    reject: PyObject,
    request_ready: PyObject,
    stream_aborted: PyObject,
    connection_ended: PyObject,
    limits: PyObject,
    body_budget: PyObject,
    monotonic: PyObject,
    logger: PyObject,
}

static CLASSES: GILOnceCell<Classes> = GILOnceCell::new();

fn classes(py: Python<'_>) -> PyResult<&'static Classes> {
    CLASSES.get_or_try_init(py, || {
        let ev = py.import_bound("zerolayer.runtime.protocol.events")?;
        let lim = py.import_bound("zerolayer.runtime.limits")?;
        let logging = py.import_bound("logging")?;
        Ok(Classes {
            request_head: ev.getattr("RequestHead")?.unbind(),
            reject: ev.getattr("Reject")?.unbind(),
            request_ready: ev.getattr("RequestReady")?.unbind(),
            stream_aborted: ev.getattr("StreamAborted")?.unbind(),
            connection_ended: ev.getattr("ConnectionEnded")?.unbind(),
            limits: lim.getattr("Limits")?.unbind(),
            body_budget: lim.getattr("BodyBudget")?.unbind(),
            monotonic: py.import_bound("time")?.getattr("monotonic")?.unbind(),
            logger: logging
                .call_method1("getLogger", ("zerolayer.runtime.protocol.h2native",))?
                .unbind(),
        })
    })
}

fn stream_aborted(py: Python<'_>, sid: u32, code: u32) -> PyObject {
    let c = classes(py).expect("classes");
    c.stream_aborted.call1(py, (sid, code)).expect("StreamAborted")
}

fn connection_ended(py: Python<'_>, code: u32, reason: &str) -> PyObject {
    let c = classes(py).expect("classes");
    c.connection_ended.call1(py, (code, reason)).expect("ConnectionEnded")
}

// ---------------------------------------------------------------------------------------- io
#[derive(Default)]
struct OutScan {
    head: [u8; 9],
    have: usize,
    skip: usize,
    /// DATA payload bytes sent per stream (for the send-window check on send-closed streams).
    sent: std::collections::HashMap<u32, u64>,
}

impl OutScan {
    /// Non-empty DATA frames in ``data`` (frames may straddle writes).
    fn feed(&mut self, mut data: &[u8]) -> u64 {
        let mut n = 0;
        while !data.is_empty() {
            if self.skip > 0 {
                let k = self.skip.min(data.len());
                self.skip -= k;
                data = &data[k..];
                continue;
            }
            let k = (9 - self.have).min(data.len());
            self.head[self.have..self.have + k].copy_from_slice(&data[..k]);
            self.have += k;
            data = &data[k..];
            if self.have == 9 {
                let len = ((self.head[0] as usize) << 16) | ((self.head[1] as usize) << 8) | self.head[2] as usize;
                if self.head[3] == 0 && len > 0 {
                    n += 1;
                    let sid = u32::from_be_bytes([self.head[5] & 0x7f, self.head[6], self.head[7], self.head[8]]);
                    *self.sent.entry(sid).or_insert(0) += len as u64;
                }
                self.skip = len;
                self.have = 0;
            }
        }
        n
    }
}

#[derive(Default)]
struct Bufs {
    input: Vec<u8>,
    pos: usize,
    out: Vec<u8>,
    scan: OutScan,
    data_frames: u64,
}

struct Io(Rc<RefCell<Bufs>>);

impl AsyncRead for Io {
    fn poll_read(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let mut b = self.0.borrow_mut();
        let avail = b.input.len() - b.pos;
        if avail == 0 {
            return Poll::Pending;
        }
        let n = avail.min(buf.remaining());
        let start = b.pos;
        buf.put_slice(&b.input[start..start + n]);
        b.pos += n;
        if b.pos == b.input.len() {
            b.input.clear();
            b.pos = 0;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Io {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let mut b = self.0.borrow_mut();
        b.out.extend_from_slice(data);
        let n = b.scan.feed(data);
        b.data_frames += n;
        Poll::Ready(Ok(data.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

// ---------------------------------------------------------------------------------------- limits
#[derive(Clone, Copy)]
struct Lims {
    max_header_list_size: u64,
    max_header_count: u64,
    max_continuation_frames: u64,
    max_queued_control_frames: u64,
    max_concurrent_streams: u64,
    max_body_bytes: u64,
    max_frame_size: u64,
    initial_window_size: u64,
    stream_buffer_low: u64,
    header_timeout_s: f64,
    body_timeout_s: f64,
    write_timeout_s: f64,
}

struct TokenBucket {
    capacity: f64,
    rate: f64,
    tokens: f64,
    stamp: f64,
}

impl TokenBucket {
    fn new(capacity: f64, rate: f64, now: f64) -> Self {
        TokenBucket { capacity, rate, tokens: capacity, stamp: now }
    }
    fn credit(&mut self, amount: f64) {
        self.tokens = self.capacity.min(self.tokens + amount);
    }
    fn take(&mut self, now: f64) -> bool {
        self.tokens = self.capacity.min(self.tokens + (now - self.stamp) * self.rate);
        self.stamp = now;
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

enum Trip {
    Limit(&'static str),
    BadPreface,
}

fn trip_message(name: &str) -> &'static str {
    match name {
        "max_queued_control_frames" => "too many PING/SETTINGS answers queued unread",
        "ignored_frames_burst" => "flood of PRIORITY, ACK or unknown frames",
        "window_update_burst" => "WINDOW_UPDATE flood",
        "empty_frames_burst" => "flood of empty frames",
        "max_continuation_frames" => "too many CONTINUATION frames in one header block",
        "rapid_reset_burst" => "rapid reset budget exceeded",
        "max_header_list_size" => "header list larger than max_header_list_size",
        _ => "limit exceeded",
    }
}

/// The inbound frame scanner: the Python core's `_inspect` and `_GuardedFrameBuffer`, over headers.
struct Scanner {
    preface: usize,
    head: [u8; 64],
    have: usize,
    skip: usize,
    block_frames: u64,
    block_bytes: u64,
    highest: u32,
    goaway: Option<(u32, usize)>,  // the peer's GOAWAY: its code, where it began in the chunk
    /// The peer's SETTINGS_INITIAL_WINDOW_SIZE, and its WINDOW_UPDATE increments per stream: h2
    /// ignores updates to a stream whose send side has closed, RFC 9113 §6.9.1 still wants an
    /// overflow past 2^31-1 answered FLOW_CONTROL_ERROR (h2spec 6.9.1/3; the Python core does).
    peer_initial_window: i64,
    increments: std::collections::HashMap<u32, i64>,
    updated: Vec<u32>,
    frame_start: usize,
    last_type: u8,
    // guards
    resets: TokenBucket,
    empty: TokenBucket,
    window_updates: TokenBucket,
    ignored: TokenBucket,
    queued_control: u64,
    block_since: Option<f64>,
    lim: Lims,
}

impl Scanner {
    /// Inspect every frame whose header (plus pad length / GOAWAY code) is complete in ``data``.
    fn scan(&mut self, mut data: &[u8], now: f64) -> Result<(), Trip> {
        let total = data.len();
        // Where the frame being read began in this chunk (0: it began in an earlier one).
        self.frame_start = 0;
        while !data.is_empty() {
            if self.preface < PREFACE.len() {
                let k = (PREFACE.len() - self.preface).min(data.len());
                if data[..k] != PREFACE[self.preface..self.preface + k] {
                    return Err(Trip::BadPreface);
                }
                self.preface += k;
                data = &data[k..];
                continue;
            }
            if self.skip > 0 {
                let k = self.skip.min(data.len());
                self.skip -= k;
                data = &data[k..];
                continue;
            }
            if self.have == 0 {
                self.frame_start = total - data.len();
            }
            let want = self.wanted();
            let k = (want - self.have).min(data.len());
            self.head[self.have..self.have + k].copy_from_slice(&data[..k]);
            self.have += k;
            data = &data[k..];
            if self.have == self.wanted() {
                let len = self.frame_len();
                let extra = self.have - 9;
                self.inspect(now)?;
                self.skip = len - extra;
                self.have = 0;
            }
        }
        Ok(())
    }

    fn frame_len(&self) -> usize {
        ((self.head[0] as usize) << 16) | ((self.head[1] as usize) << 8) | self.head[2] as usize
    }

    /// Bytes needed before the frame can be inspected: its header, then the pad length of a
    /// padded DATA/HEADERS frame or the last-stream-id and code of a GOAWAY.
    fn wanted(&self) -> usize {
        if self.have < 9 {
            return 9;
        }
        let len = self.frame_len();
        let (ty, flags) = (self.head[3], self.head[4]);
        match ty {
            0 | 1 if flags & 0x8 != 0 && len >= 1 => 10,
            7 if len >= 8 => 17,
            4 if flags & 0x1 == 0 && len <= 54 && len % 6 == 0 => 9 + len,
            8 if len == 4 => 13,
            _ => 9,
        }
    }

    fn inspect(&mut self, now: f64) -> Result<(), Trip> {
        let len = self.frame_len() as u64;
        let (ty, flags) = (self.head[3], self.head[4]);
        let sid = u32::from_be_bytes([self.head[5] & 0x7f, self.head[6], self.head[7], self.head[8]]);
        self.last_type = ty;
        let pad = if (ty == 0 || ty == 1) && flags & 0x8 != 0 && len >= 1 { 1 + self.head[9] as u64 } else { 0 };
        match ty {
            4 | 6 if flags & 0x1 == 0 => {
                self.queued_control += 1;
                if self.queued_control > self.lim.max_queued_control_frames {
                    return Err(Trip::Limit("max_queued_control_frames"));
                }
                if ty == 4 && sid == 0 && len % 6 == 0 && self.have == 9 + len as usize {
                    for p in self.head[9..9 + len as usize].chunks_exact(6) {
                        if u16::from_be_bytes([p[0], p[1]]) == 0x4 {
                            self.peer_initial_window = u32::from_be_bytes([p[2], p[3], p[4], p[5]]) as i64;
                        }
                    }
                }
            }
            2 | 4 | 6 | 0xa | 0xb..=0xff => {
                if !self.ignored.take(now) {
                    return Err(Trip::Limit("ignored_frames_burst"));
                }
            }
            8 => {
                if !self.window_updates.take(now) {
                    return Err(Trip::Limit("window_update_burst"));
                }
                if sid != 0 && self.have == 13 {
                    let inc = (u32::from_be_bytes([self.head[9], self.head[10], self.head[11], self.head[12]]) & 0x7fff_ffff) as i64;
                    *self.increments.entry(sid).or_insert(0) += inc;
                    self.updated.push(sid);
                }
            }
            3 => {
                // Every client RST_STREAM takes a token (the Python core: every one h2 reports).
                if !self.resets.take(now) {
                    return Err(Trip::Limit("rapid_reset_burst"));
                }
            }
            7 => {
                if len >= 8 && self.goaway.is_none() {
                    let code = u32::from_be_bytes([self.head[13], self.head[14], self.head[15], self.head[16]]);
                    self.goaway = Some((code, self.frame_start));
                }
            }
            _ => {}
        }
        if ty == 0 || ty == 1 || ty == 9 {
            let prio = if ty == 1 && flags & 0x20 != 0 { 5 } else { 0 };
            let data_len = len.saturating_sub(pad + prio);
            let end_stream = ty != 9 && flags & 0x1 != 0;
            let mut empty = data_len == 0 && !end_stream;
            if ty == 1 || ty == 9 {
                let end_headers = flags & 0x4 != 0;
                empty = empty && !end_headers;
                if end_headers {
                    self.block_since = None;
                } else if self.block_since.is_none() {
                    self.block_since = Some(now);
                }
            }
            if empty && !self.empty.take(now) {
                return Err(Trip::Limit("empty_frames_burst"));
            }
        }
        // CONTINUATION frames per header block (h2's own, lower limit may end it first: see docs).
        if ty == 9 && self.block_frames > 0 && self.block_frames >= self.lim.max_continuation_frames {
            return Err(Trip::Limit("max_continuation_frames"));
        }
        if ty == 1 || ty == 5 || (ty == 9 && self.block_frames > 0) {
            let fragment = if ty == 9 { len } else { len.saturating_sub(pad + if ty == 1 && flags & 0x20 != 0 { 5 } else { 0 }) };
            self.block_bytes = if ty == 9 { self.block_bytes + fragment } else { fragment };
            // A compressed block larger than the limit decodes larger still (hpack only shrinks
            // honest header lists): the connection ends as when python-hpack's decoder refuses it.
            if self.block_bytes > self.lim.max_header_list_size {
                return Err(Trip::Limit("max_header_list_size"));
            }
            if flags & 0x4 != 0 {
                self.block_frames = 0;
            } else {
                self.block_frames += 1;
            }
        }
        if ty == 1 && sid % 2 == 1 && sid > self.highest {
            self.highest = sid;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------- streams
struct Stream {
    head: PyObject,
    content_length: Option<u64>,
    opened: f64,
    owner: PyObject,
    gating: bool,
    accepted: bool,
    rejected: bool,
    discarded: u64,
    context: PyObject,
    max_body: u64,
    body: Vec<u8>,
    remote_ended: bool,
    out: VecDeque<Bytes>,
    out_bytes: u64,
    end_pending: bool,
    local_ended: bool,
    stop_reading: bool,
    stalled_since: Option<f64>,
    recv: Option<RecvStream>,
    respond: Option<SendResponse<Bytes>>,
    send: Option<SendStream<Bytes>>,
}

impl Stream {
    fn large_body(&self) -> bool {
        matches!(self.content_length, Some(n) if n > EARLY_RESET_BODY)
    }
    fn reset(&mut self, code: u32) {
        if let Some(s) = self.send.as_mut() {
            s.send_reset(Reason::from(code));
        } else if let Some(r) = self.respond.as_mut() {
            r.send_reset(Reason::from(code));
        }
    }
}

enum Verdict {
    Accept { max_body: u64, context: PyObject, owner: PyObject },
    Reject { status: u16, headers: Vec<(String, String)>, body: Bytes },
}

enum State {
    Handshaking(Pin<Box<Handshake<Io, Bytes>>>),
    Open(Connection<Io, Bytes>),
    Done,
}

struct Shared {
    gate: PyObject,
    limits: PyObject,
    on_limit: PyObject,
    clock: PyObject,
    budget: PyObject,
    ended: Cell<bool>,
    draining: Cell<bool>,
    last_activity: Cell<f64>,
    discarded: Cell<u64>,
}

impl Shared {
    fn on_limit(&self, py: Python<'_>, name: &str) {
        if let Err(e) = self.on_limit.call1(py, (name,)) {
            e.write_unraisable_bound(py, None);
        }
    }
    fn give(&self, py: Python<'_>, owner: &PyObject, n: usize) {
        if n > 0 {
            if let Err(e) = self.budget.call_method1(py, "give", (owner.clone_ref(py), n)) {
                e.write_unraisable_bound(py, None);
            }
        }
    }
}

struct Inner {
    state: State,
    bufs: Rc<RefCell<Bufs>>,
    scan: Scanner,
    streams: BTreeMap<u32, Stream>,
    drain_last: u32,
    ping: Option<PingPong>,
    credited_frames: u64,
    conn_error: Option<h2::Error>,
}

/// A new request waiting for the gate (called with no borrow of the core held).
struct Gating {
    sid: u32,
    head: PyObject,
    too_many: bool,
}

fn waker() -> Waker {
    futures_util::task::noop_waker()
}

impl Inner {
    /// Poll the connection without accepting streams: writes whatever h2 has queued.
    fn pump(&mut self) {
        let w = waker();
        let mut cx = Context::from_waker(&w);
        if let State::Open(conn) = &mut self.state {
            if let Poll::Ready(Err(e)) = conn.poll_closed(&mut cx) {
                if self.conn_error.is_none() {
                    self.conn_error = Some(e);
                }
            }
        }
        if let Some(pp) = self.ping.as_mut() {
            let _ = pp.poll_pong(&mut cx);
        }
        self.credit();
    }

    fn credit(&mut self) {
        let frames = self.bufs.borrow().data_frames;
        if frames > self.credited_frames {
            // A reader acknowledges our DATA with WINDOW_UPDATEs (stream + connection).
            self.scan.window_updates.credit(2.0 * (frames - self.credited_frames) as f64);
            self.credited_frames = frames;
        }
    }

    fn drive(&mut self, py: Python<'_>, sh: &Shared, now: f64, out: &mut Vec<PyObject>) -> Vec<Gating> {
        let w = waker();
        let mut cx = Context::from_waker(&w);
        let mut gating = Vec::new();
        loop {
            if sh.ended.get() {
                return gating;
            }
            let mut progress = false;
            if let State::Handshaking(hs) = &mut self.state {
                match hs.as_mut().poll(&mut cx) {
                    Poll::Ready(Ok(mut conn)) => {
                        self.ping = conn.ping_pong();
                        self.state = State::Open(conn);
                    }
                    Poll::Ready(Err(e)) => {
                        self.conn_failed(py, sh, e, out);
                        return gating;
                    }
                    Poll::Pending => {}
                }
            }
            let mut accepted = Vec::new();
            let mut failure: Option<Option<h2::Error>> = None;
            if let State::Open(conn) = &mut self.state {
                loop {
                    match conn.poll_accept(&mut cx) {
                        Poll::Ready(Some(Ok(pair))) => accepted.push(pair),
                        Poll::Ready(Some(Err(e))) => {
                            failure = Some(Some(e));
                            break;
                        }
                        Poll::Ready(None) => {
                            failure = Some(None);
                            break;
                        }
                        Poll::Pending => break,
                    }
                }
                if let Some(pp) = self.ping.as_mut() {
                    let _ = pp.poll_pong(&mut cx);
                }
            }
            for (req, respond) in accepted {
                progress = true;
                let sid: u32 = respond.stream_id().into();
                if let Some(g) = self.on_request(py, sh, now, sid, req, respond) {
                    gating.push(g);
                }
            }
            match failure {
                Some(Some(e)) => {
                    self.conn_failed(py, sh, e, out);
                    return gating;
                }
                Some(None) => {
                    self.end(py, sh, out, NO_ERROR, "connection closed", false);
                    return gating;
                }
                None => {}
            }
            if let Some(e) = self.conn_error.take() {
                self.conn_failed(py, sh, e, out);
                return gating;
            }
            self.credit();
            let sids: Vec<u32> = self.streams.keys().copied().collect();
            for sid in sids {
                if sh.ended.get() {
                    return gating;
                }
                progress |= self.poll_stream(py, sh, now, sid, out, &mut cx);
            }
            if !progress {
                return gating;
            }
        }
    }

    fn on_request(
        &mut self,
        py: Python<'_>,
        sh: &Shared,
        now: f64,
        sid: u32,
        req: http::Request<RecvStream>,
        mut respond: SendResponse<Bytes>,
    ) -> Option<Gating> {
        sh.last_activity.set(now);
        if sh.draining.get() && sid > self.drain_last {
            respond.send_reset(Reason::from(REFUSED_STREAM));
            return None;
        }
        let (parts, recv) = req.into_parts();
        let headers = PyDict::new_bound(py);
        let mut count: u64 = 0;
        let mut host: Option<String> = None;
        let mut content_length = None;
        for (name, value) in parts.headers.iter() {
            count += 1;
            let key = name.as_str();
            let val: String = value.as_bytes().iter().map(|&b| b as char).collect();
            if key == "host" && host.is_none() {
                host = Some(val.clone());
            }
            if key == "content-length" && content_length.is_none() {
                content_length = Some(val.clone());
            }
            match headers.get_item(key).ok().flatten() {
                Some(prev) => {
                    let joined = format!("{}, {}", prev.extract::<String>().unwrap_or_default(), val);
                    let _ = headers.set_item(key, joined);
                }
                None => {
                    let _ = headers.set_item(key, val);
                }
            }
        }
        let authority = match parts.uri.authority() {
            Some(a) => a.as_str().to_string(),
            None => host.unwrap_or_default(),
        };
        let path = parts.uri.path_and_query().map(|p| p.as_str().to_string()).unwrap_or_default();
        let end_stream = recv.is_end_stream();
        let c = classes(py).expect("classes");
        let kwargs = PyDict::new_bound(py);
        let _ = kwargs.set_item("stream_id", sid);
        let _ = kwargs.set_item("method", parts.method.as_str());
        let _ = kwargs.set_item("path", path);
        let _ = kwargs.set_item("headers", headers);
        let _ = kwargs.set_item("authority", authority);
        let _ = kwargs.set_item("end_stream", end_stream);
        let head = c.request_head.call_bound(py, (), Some(&kwargs)).expect("RequestHead");
        let content_length = content_length.and_then(|v| {
            if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) { v.parse::<u64>().ok().or(Some(u64::MAX)) } else { None }
        });
        self.streams.insert(
            sid,
            Stream {
                head: head.clone_ref(py),
                content_length,
                opened: now,
                owner: py.None(),
                gating: true,
                accepted: false,
                rejected: false,
                discarded: 0,
                context: py.None(),
                max_body: 0,
                body: Vec::new(),
                remote_ended: end_stream,
                out: VecDeque::new(),
                out_bytes: 0,
                end_pending: false,
                local_ended: false,
                stop_reading: false,
                stalled_since: None,
                recv: Some(recv),
                respond: Some(respond),
                send: None,
            },
        );
        Some(Gating { sid, head, too_many: count > self.scan.lim.max_header_count })
    }

    fn apply_verdict(&mut self, py: Python<'_>, sh: &Shared, now: f64, sid: u32, verdict: Verdict, out: &mut Vec<PyObject>) {
        let Some(st) = self.streams.get_mut(&sid) else { return };
        st.gating = false;
        match verdict {
            Verdict::Reject { status, headers, body } => self.reject(py, sh, now, sid, status, headers, body),
            Verdict::Accept { max_body, context, owner } => {
                st.accepted = true;
                st.context = context;
                st.max_body = max_body;
                st.owner = owner;
                if st.remote_ended {
                    // HEADERS with END_STREAM: the request is complete now.
                    self.stream_ended(py, sh, sid, out);
                }
            }
        }
    }

    fn reject(&mut self, py: Python<'_>, sh: &Shared, now: f64, sid: u32, status: u16, headers: Vec<(String, String)>, body: Bytes) {
        if let Some(st) = self.streams.get_mut(&sid) {
            st.rejected = true;
        }
        self.send_head(py, sh, sid, status, headers);
        self.send_data(py, sh, now, sid, body, true);
    }

    /// One stream's inbound data, peer resets and queued output. True if anything moved.
    fn poll_stream(&mut self, py: Python<'_>, sh: &Shared, now: f64, sid: u32, out: &mut Vec<PyObject>, cx: &mut Context<'_>) -> bool {
        let mut progress = false;
        loop {
            let Some(st) = self.streams.get_mut(&sid) else { return progress };
            if st.gating {
                return progress;
            }
            let Some(recv) = st.recv.as_mut() else { break };
            match recv.poll_data(cx) {
                Poll::Ready(Some(Ok(data))) => {
                    progress = true;
                    let _ = recv.flow_control().release_capacity(data.len());
                    self.on_data(py, sh, now, sid, data, out);
                }
                Poll::Ready(Some(Err(e))) => {
                    progress = true;
                    self.on_stream_error(py, sh, sid, e, out);
                    return progress;
                }
                Poll::Ready(None) => {
                    progress = true;
                    let _ = recv.poll_trailers(cx);
                    st.recv = None;
                    if !st.remote_ended {
                        self.stream_ended(py, sh, sid, out);
                    }
                    break;
                }
                Poll::Pending => break,
            }
        }
        let Some(st) = self.streams.get_mut(&sid) else { return progress };
        if st.recv.is_none() {
            let polled = if let Some(s) = st.send.as_mut() {
                s.poll_reset(cx)
            } else if let Some(r) = st.respond.as_mut() {
                r.poll_reset(cx)
            } else {
                Poll::Pending
            };
            match polled {
                Poll::Ready(Ok(reason)) => {
                    self.peer_reset(py, sh, sid, reason.into(), out);
                    return true;
                }
                Poll::Ready(Err(e)) => {
                    self.on_stream_error(py, sh, sid, e, out);
                    return true;
                }
                Poll::Pending => {}
            }
        }
        let Some(st) = self.streams.get(&sid) else { return progress };
        if !st.out.is_empty() || (st.end_pending && !st.local_ended) {
            progress |= self.flush(py, sh, now, sid);
        }
        progress
    }

    fn on_stream_error(&mut self, py: Python<'_>, sh: &Shared, sid: u32, e: h2::Error, out: &mut Vec<PyObject>) {
        let code: u32 = e.reason().map(u32::from).unwrap_or(CANCEL);
        if e.is_reset() && e.is_remote() {
            self.peer_reset(py, sh, sid, code, out);
        } else if e.is_go_away() || e.is_io() {
            // The connection is going: the connection-level error reports it.
        } else {
            // h2 reset the stream itself (a stream error of the peer's): stop work for it.
            if let Some(st) = self.forget(py, sh, sid) {
                if st.accepted {
                    out.push(stream_aborted(py, sid, code));
                }
            }
            self.drained(py, sh, out);
        }
    }

    fn peer_reset(&mut self, py: Python<'_>, sh: &Shared, sid: u32, code: u32, out: &mut Vec<PyObject>) {
        if let Some(st) = self.forget(py, sh, sid) {
            if st.accepted {
                out.push(stream_aborted(py, sid, code));
            }
        }
        self.drained(py, sh, out);
    }

    fn on_data(&mut self, py: Python<'_>, sh: &Shared, now: f64, sid: u32, data: Bytes, out: &mut Vec<PyObject>) {
        sh.last_activity.set(now);
        let n = data.len() as u64;
        let lim = self.scan.lim;
        let Some(st) = self.streams.get_mut(&sid) else { return };
        if !st.accepted {
            sh.discarded.set(sh.discarded.get() + n);
            st.discarded += n;
            if st.discarded > lim.max_body_bytes && st.local_ended {
                // Still sending a body nobody will read: ask it to stop (RFC 9113 §8.1).
                self.pump();
                if let Some(st) = self.streams.get_mut(&sid) {
                    st.reset(NO_ERROR);
                }
                self.forget(py, sh, sid);
            }
            return;
        }
        if st.body.len() as u64 + n > st.max_body {
            sh.on_limit(py, "max_body_bytes");
            sh.discarded.set(sh.discarded.get() + n);
            self.refuse_body(py, sh, now, sid, 413, vec![("content-type".into(), "text/plain".into())],
                             Bytes::from_static(b"request body too large\n"), out);
            return;
        }
        let refused = match sh.budget.call_method1(py, "take", (st.owner.clone_ref(py), n)) {
            Ok(v) if v.is_none(py) => None,
            Ok(v) => Some(v.extract::<String>(py).unwrap_or_else(|_| "max_buffered_body_bytes".into())),
            Err(e) => {
                e.write_unraisable_bound(py, None);
                Some("max_buffered_body_bytes".into())
            }
        };
        if let Some(name) = refused {
            sh.on_limit(py, &name);
            sh.discarded.set(sh.discarded.get() + n);
            self.refuse_body(py, sh, now, sid, 503,
                             vec![("content-type".into(), "text/plain".into()), ("retry-after".into(), "1".into())],
                             Bytes::from_static(b"too many request bodies buffered; retry later\n"), out);
            return;
        }
        if let Some(st) = self.streams.get_mut(&sid) {
            st.body.extend_from_slice(&data);
        }
    }

    fn stream_ended(&mut self, py: Python<'_>, sh: &Shared, sid: u32, out: &mut Vec<PyObject>) {
        let Some(st) = self.streams.get_mut(&sid) else { return };
        st.remote_ended = true;
        if st.accepted {
            let body = std::mem::take(&mut st.body);
            let c = classes(py).expect("classes");
            let ready = c
                .request_ready
                .call1(py, (st.head.clone_ref(py), PyBytes::new_bound(py, &body), st.context.clone_ref(py)))
                .expect("RequestReady");
            out.push(ready);
            sh.give(py, &st.owner, body.len());
        }
        self.maybe_forget(py, sh, sid);
    }

    fn refuse_body(&mut self, py: Python<'_>, sh: &Shared, now: f64, sid: u32, status: u16, headers: Vec<(String, String)>, body: Bytes, out: &mut Vec<PyObject>) {
        if let Some(st) = self.streams.get_mut(&sid) {
            st.accepted = false;
            st.stop_reading = true;
            let taken = std::mem::take(&mut st.body);
            sh.give(py, &st.owner, taken.len());
        }
        self.reject(py, sh, now, sid, status, headers, body);
        out.push(stream_aborted(py, sid, NO_ERROR));
    }

    fn send_head(&mut self, py: Python<'_>, sh: &Shared, sid: u32, status: u16, headers: Vec<(String, String)>) {
        if sh.ended.get() {
            return;
        }
        let Some(st) = self.streams.get_mut(&sid) else { return };
        let ok = (|| {
            let mut resp = Response::new(());
            *resp.status_mut() = StatusCode::from_u16(status).ok()?;
            let map = resp.headers_mut();
            for (k, v) in headers {
                let name = HeaderName::from_bytes(k.as_bytes()).ok()?;
                let value = HeaderValue::from_bytes(v.as_bytes()).ok()?;
                map.append(name, value);
            }
            let respond = st.respond.as_mut()?;
            let send = respond.send_response(resp, false).ok()?;
            Some(send)
        })();
        match ok {
            Some(send) => {
                st.respond = None;
                st.send = Some(send);
            }
            None => {
                self.forget(py, sh, sid);
            }
        }
    }

    fn send_data(&mut self, py: Python<'_>, sh: &Shared, now: f64, sid: u32, data: Bytes, end: bool) {
        let Some(st) = self.streams.get_mut(&sid) else { return };
        if sh.ended.get() || st.local_ended {
            return;
        }
        sh.last_activity.set(now);
        if !data.is_empty() {
            st.out_bytes += data.len() as u64;
            st.out.push_back(data);
        }
        if end {
            st.end_pending = true;
        }
        self.flush(py, sh, now, sid);
    }

    /// Hand queued output to h2 as far as its send capacity (the peer's windows) goes.
    fn flush(&mut self, py: Python<'_>, sh: &Shared, now: f64, sid: u32) -> bool {
        let mut progress = false;
        let mut failed = false;
        let mut early_reset = false;
        {
            let Some(st) = self.streams.get_mut(&sid) else { return false };
            let Some(send) = st.send.as_mut() else { return false };
            'outer: while !st.out.is_empty() {
                send.reserve_capacity(st.out_bytes as usize);
                let mut cap = send.capacity();
                if cap == 0 {
                    if st.stalled_since.is_none() {
                        st.stalled_since = Some(now);
                    }
                    return progress;
                }
                st.stalled_since = None;
                while cap > 0 {
                    let Some(mut chunk) = st.out.pop_front() else { break };
                    if chunk.len() > cap {
                        let rest = chunk.split_off(cap);
                        st.out.push_front(rest);
                    }
                    cap -= chunk.len();
                    st.out_bytes -= chunk.len() as u64;
                    progress = true;
                    if send.send_data(chunk, false).is_err() {
                        failed = true;
                        break 'outer;
                    }
                }
            }
            if !failed && st.end_pending && !st.local_ended {
                progress = true;
                if send.send_data(Bytes::new(), true).is_err() {
                    failed = true;
                } else {
                    st.local_ended = true;
                    early_reset = st.rejected && !st.remote_ended && (st.stop_reading || st.large_body());
                }
            }
        }
        if failed {
            self.forget(py, sh, sid);
            return true;
        }
        if early_reset {
            // RFC 9113 §8.1: a complete early response, then ask the client to stop sending.
            self.pump();
            if let Some(st) = self.streams.get_mut(&sid) {
                st.reset(NO_ERROR);
                st.remote_ended = true;
            }
        }
        self.maybe_forget(py, sh, sid);
        progress
    }

    fn maybe_forget(&mut self, py: Python<'_>, sh: &Shared, sid: u32) {
        let mut dummy = Vec::new();
        self.maybe_forget_into(py, sh, sid, &mut dummy);
    }

    fn maybe_forget_into(&mut self, py: Python<'_>, sh: &Shared, sid: u32, out: &mut Vec<PyObject>) {
        if let Some(st) = self.streams.get(&sid) {
            if st.local_ended && st.remote_ended {
                self.forget(py, sh, sid);
                self.drained(py, sh, out);
            }
        }
    }

    fn forget(&mut self, py: Python<'_>, sh: &Shared, sid: u32) -> Option<Stream> {
        let st = self.streams.remove(&sid)?;
        self.scan.increments.remove(&sid);
        self.bufs.borrow_mut().scan.sent.remove(&sid);
        sh.give(py, &st.owner, st.body.len());
        Some(st)
    }

    fn drained(&mut self, py: Python<'_>, sh: &Shared, out: &mut Vec<PyObject>) {
        if sh.draining.get() && self.streams.is_empty() && !sh.ended.get() {
            self.end(py, sh, out, NO_ERROR, "drained", true);
        }
    }

    /// WINDOW_UPDATEs on streams whose response has ended (h2 ignores those): one that takes the
    /// send window past 2^31-1 resets the stream with FLOW_CONTROL_ERROR, as python-hyper h2 does.
    fn check_send_windows(&mut self, py: Python<'_>, sh: &Shared, out: &mut Vec<PyObject>) {
        let updated = std::mem::take(&mut self.scan.updated);
        for sid in updated {
            let Some(st) = self.streams.get(&sid) else { continue };
            if !st.local_ended || sh.ended.get() {
                continue;
            }
            let sent = self.bufs.borrow().scan.sent.get(&sid).copied().unwrap_or(0) as i64;
            let window = self.scan.peer_initial_window + self.scan.increments.get(&sid).copied().unwrap_or(0) - sent;
            if window > 0x7fff_ffff {
                self.pump();
                if let Some(mut st) = self.forget(py, sh, sid) {
                    st.reset(0x3); // FLOW_CONTROL_ERROR
                    if st.accepted {
                        out.push(stream_aborted(py, sid, 0x3));
                    }
                }
                self.pump();
                self.drained(py, sh, out);
            }
        }
    }

    fn conn_failed(&mut self, py: Python<'_>, sh: &Shared, e: h2::Error, out: &mut Vec<PyObject>) {
        let code: u32 = e.reason().map(u32::from).unwrap_or(PROTOCOL_ERROR);
        if e.is_go_away() && e.is_remote() {
            self.end(py, sh, out, code, "peer sent GOAWAY", false);
            return;
        }
        if code == ENHANCE_YOUR_CALM {
            // h2's own limits (CONTINUATION frames per block, lifetime empty DATA frames).
            let name = match self.scan.last_type {
                9 | 1 => "max_continuation_frames",
                0 => "empty_frames_burst",
                _ => "h2_enhance_your_calm",
            };
            sh.on_limit(py, name);
        }
        self.end(py, sh, out, code, &e.to_string(), false);
    }

    /// End the connection: GOAWAY (ours, after h2's pending output) unless h2 sent one or the peer
    /// closed, then every accepted stream is aborted and the connection reported ended.
    fn end(&mut self, py: Python<'_>, sh: &Shared, out: &mut Vec<PyObject>, code: u32, reason: &str, goaway: bool) {
        if sh.ended.get() {
            return;
        }
        sh.ended.set(true);
        if goaway {
            self.pump();
            let last = if sh.draining.get() { self.drain_last } else { self.scan.highest };
            let mut frame = vec![0u8, 0, 8, 7, 0, 0, 0, 0, 0];
            frame.extend_from_slice(&last.to_be_bytes());
            frame.extend_from_slice(&code.to_be_bytes());
            self.bufs.borrow_mut().out.extend_from_slice(&frame);
        } else {
            self.pump();
        }
        self.state = State::Done;
        let streams = std::mem::take(&mut self.streams);
        for (sid, st) in streams {
            sh.give(py, &st.owner, st.body.len());
            if st.accepted {
                out.push(stream_aborted(py, sid, code));
            }
        }
        out.push(connection_ended(py, code, reason));
    }
}

// ---------------------------------------------------------------------------------------- the class
/// One server-side HTTP/2 connection, sans I/O, on the Rust ``h2`` crate.
#[pyclass(unsendable, subclass, module = "zerolayer_h2core")]
struct H2Core {
    sh: Shared,
    inner: RefCell<Inner>,
}

fn get_f(py: Python<'_>, obj: &PyObject, name: &str) -> PyResult<f64> {
    obj.getattr(py, name)?.extract::<f64>(py)
}

fn get_u(py: Python<'_>, obj: &PyObject, name: &str) -> PyResult<u64> {
    obj.getattr(py, name)?.extract::<u64>(py)
}

fn parse_headers(py: Python<'_>, headers: &Bound<'_, PyAny>) -> PyResult<Vec<(String, String)>> {
    let mut out = Vec::new();
    for item in headers.iter()? {
        let item = item?;
        let k = item.get_item(0)?;
        let v = item.get_item(1)?;
        let k: String = k.str()?.to_str()?.to_lowercase();
        let v: String = v.str()?.to_str()?.to_string();
        out.push((k, v));
    }
    let _ = py;
    Ok(out)
}

fn parse_verdict(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<Verdict> {
    let c = classes(py)?;
    if v.is_instance(c.reject.bind(py))? {
        let status: u16 = v.getattr("status")?.extract()?;
        let headers = parse_headers(py, &v.getattr("headers")?)?;
        let body: Vec<u8> = v.getattr("body")?.extract()?;
        return Ok(Verdict::Reject { status, headers, body: Bytes::from(body) });
    }
    let max_body: i64 = v.getattr("max_body")?.extract()?;
    Ok(Verdict::Accept {
        max_body: max_body.max(0) as u64,
        context: v.getattr("context")?.unbind(),
        owner: v.getattr("owner")?.unbind(),
    })
}

fn gate_failed() -> Verdict {
    Verdict::Reject {
        status: 500,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: Bytes::from_static(b"internal error\n"),
    }
}

impl H2Core {
    /// Drive h2 until nothing moves, calling the gate for each new request with no borrow held.
    fn run(&self, py: Python<'_>, now: f64, out: &mut Vec<PyObject>) {
        loop {
            let gating = self.inner.borrow_mut().drive(py, &self.sh, now, out);
            if gating.is_empty() {
                return;
            }
            for g in gating {
                let verdict = if g.too_many {
                    self.sh.on_limit(py, "max_header_count");
                    Verdict::Reject {
                        status: 431,
                        headers: vec![("content-type".into(), "text/plain".into())],
                        body: Bytes::from_static(b"too many header fields\n"),
                    }
                } else {
                    match self.sh.gate.call1(py, (g.head.clone_ref(py),)).and_then(|v| parse_verdict(py, v.bind(py))) {
                        Ok(v) => v,
                        Err(e) => {
                            let c = classes(py).expect("classes");
                            let kw = PyDict::new_bound(py);
                            let _ = kw.set_item("exc_info", e.value_bound(py));
                            let _ = c.logger.call_method_bound(py, "error", ("gate failed on stream %d", g.sid), Some(&kw));
                            gate_failed()
                        }
                    }
                };
                self.inner.borrow_mut().apply_verdict(py, &self.sh, now, g.sid, verdict, out);
            }
        }
    }

    fn now(&self, py: Python<'_>) -> f64 {
        self.sh.clock.call0(py).and_then(|v| v.extract::<f64>(py)).unwrap_or(0.0)
    }

    fn finish(&self, py: Python<'_>, now: f64, out: &mut Vec<PyObject>) {
        self.run(py, now, out);
        let mut inner = self.inner.borrow_mut();
        inner.pump();
        inner.drained(py, &self.sh, out);
    }
}

#[pymethods]
impl H2Core {
    #[new]
    #[pyo3(signature = (gate, limits=None, *, on_limit=None, clock=None, budget=None))]
    fn new(
        py: Python<'_>,
        gate: PyObject,
        limits: Option<PyObject>,
        on_limit: Option<PyObject>,
        clock: Option<PyObject>,
        budget: Option<PyObject>,
    ) -> PyResult<Self> {
        let c = classes(py)?;
        let limits = match limits {
            Some(l) if !l.is_none(py) => l,
            _ => c.limits.call0(py)?,
        };
        let on_limit = match on_limit {
            Some(f) if !f.is_none(py) => f,
            _ => py.eval_bound("lambda name: None", None, None)?.unbind(),
        };
        let clock = match clock {
            Some(f) if !f.is_none(py) => f,
            _ => c.monotonic.clone_ref(py),
        };
        let budget = match budget {
            Some(b) if !b.is_none(py) => b,
            _ => c.body_budget.call_method1(py, "from_limits", (limits.clone_ref(py),))?,
        };
        let lim = Lims {
            max_header_list_size: get_u(py, &limits, "max_header_list_size")?,
            max_header_count: get_u(py, &limits, "max_header_count")?,
            max_continuation_frames: get_u(py, &limits, "max_continuation_frames")?,
            max_queued_control_frames: get_u(py, &limits, "max_queued_control_frames")?,
            max_concurrent_streams: get_u(py, &limits, "max_concurrent_streams")?,
            max_body_bytes: get_u(py, &limits, "max_body_bytes")?,
            max_frame_size: get_u(py, &limits, "max_frame_size")?,
            initial_window_size: get_u(py, &limits, "initial_window_size")?,
            stream_buffer_low: get_u(py, &limits, "stream_buffer_low")?,
            header_timeout_s: get_f(py, &limits, "header_timeout_s")?,
            body_timeout_s: get_f(py, &limits, "body_timeout_s")?,
            write_timeout_s: get_f(py, &limits, "write_timeout_s")?,
        };
        let now: f64 = clock.call0(py)?.extract(py)?;
        let bucket = |burst: &str, rate: &str| -> PyResult<TokenBucket> {
            Ok(TokenBucket::new(get_f(py, &limits, burst)?, get_f(py, &limits, rate)?, now))
        };
        let scan = Scanner {
            preface: 0,
            head: [0; 64],
            have: 0,
            skip: 0,
            block_frames: 0,
            block_bytes: 0,
            highest: 0,
            goaway: None,
            peer_initial_window: 65535,
            increments: std::collections::HashMap::new(),
            updated: Vec::new(),
            frame_start: 0,
            last_type: 0xff,
            resets: bucket("rapid_reset_burst", "rapid_reset_per_second")?,
            empty: bucket("empty_frames_burst", "empty_frames_per_second")?,
            window_updates: bucket("window_update_burst", "window_update_per_second")?,
            ignored: bucket("ignored_frames_burst", "ignored_frames_per_second")?,
            queued_control: 0,
            block_since: None,
            lim,
        };
        let clamp = |v: u64| v.min(u32::MAX as u64) as u32;
        let bufs = Rc::new(RefCell::new(Bufs::default()));
        let mut builder = Builder::new();
        builder
            .initial_window_size(clamp(lim.initial_window_size).min((1 << 31) - 1))
            .initial_connection_window_size(clamp(lim.initial_window_size).max(65535).min((1 << 31) - 1))
            .max_frame_size(clamp(lim.max_frame_size).clamp(16384, (1 << 24) - 1))
            .max_concurrent_streams(clamp(lim.max_concurrent_streams))
            .max_header_list_size(clamp(lim.max_header_list_size))
            .max_send_buffer_size(u32::MAX as usize)
            .max_concurrent_reset_streams(100_000)
            .max_pending_accept_reset_streams(usize::MAX >> 2)
            .max_local_error_reset_streams(None)
            .data_frame_budget(usize::MAX >> 2);
        let hs = builder.handshake::<Io, Bytes>(Io(bufs.clone()));
        let core = H2Core {
            sh: Shared {
                gate,
                limits,
                on_limit,
                clock,
                budget,
                ended: Cell::new(false),
                draining: Cell::new(false),
                last_activity: Cell::new(now),
                discarded: Cell::new(0),
            },
            inner: RefCell::new(Inner {
                state: State::Handshaking(Box::pin(hs)),
                bufs,
                scan,
                streams: BTreeMap::new(),
                drain_last: 0,
                ping: None,
                credited_frames: 0,
                conn_error: None,
            }),
        };
        let mut out = Vec::new();
        core.run(py, now, &mut out);
        Ok(core)
    }

    #[getter]
    fn gate(&self, py: Python<'_>) -> PyObject { self.sh.gate.clone_ref(py) }
    #[getter]
    fn limits(&self, py: Python<'_>) -> PyObject { self.sh.limits.clone_ref(py) }
    #[getter]
    fn on_limit(&self, py: Python<'_>) -> PyObject { self.sh.on_limit.clone_ref(py) }
    #[getter]
    fn clock(&self, py: Python<'_>) -> PyObject { self.sh.clock.clone_ref(py) }
    #[getter]
    fn budget(&self, py: Python<'_>) -> PyObject { self.sh.budget.clone_ref(py) }
    #[getter]
    fn ended(&self) -> bool { self.sh.ended.get() }
    #[getter]
    fn draining(&self) -> bool { self.sh.draining.get() }
    #[getter]
    fn last_activity(&self) -> f64 { self.sh.last_activity.get() }
    #[setter]
    fn set_last_activity(&self, v: f64) { self.sh.last_activity.set(v) }
    #[getter]
    fn discarded_body_bytes(&self) -> u64 { self.sh.discarded.get() }
    /// Bytes produced for the peer and not yet taken by ``data_to_send``.
    #[getter]
    fn pending_bytes(&self) -> usize { self.inner.borrow().bufs.borrow().out.len() }

    /// Feed bytes from the peer; returns the events they complete.
    fn receive<'py>(&self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
        let mut out = Vec::new();
        if self.sh.ended.get() {
            return Ok(PyList::empty_bound(py));
        }
        let now = self.now(py);
        let tripped = self.inner.borrow_mut().scan.scan(data, now);
        match tripped {
            Err(Trip::Limit(name)) => {
                self.sh.on_limit(py, name);
                self.inner.borrow_mut().end(py, &self.sh, &mut out, ENHANCE_YOUR_CALM, trip_message(name), true);
                return Ok(PyList::new_bound(py, out));
            }
            Err(Trip::BadPreface) => {
                self.inner.borrow_mut().end(py, &self.sh, &mut out, PROTOCOL_ERROR, "invalid HTTP/2 preface", true);
                return Ok(PyList::new_bound(py, out));
            }
            Ok(()) => {}
        }
        // The peer's GOAWAY ends the connection where it stands, as in the Python core: h2 is given
        // the frames before it, never the GOAWAY or what follows.
        let goaway = self.inner.borrow_mut().scan.goaway.take();
        let fed = match goaway {
            Some((_, at)) => &data[..at],
            None => data,
        };
        self.inner.borrow().bufs.borrow_mut().input.extend_from_slice(fed);
        self.run(py, now, &mut out);
        let mut inner = self.inner.borrow_mut();
        if !inner.scan.updated.is_empty() {
            inner.check_send_windows(py, &self.sh, &mut out);
        }
        if let Some((code, _)) = goaway {
            // Nothing more will be read: every buffered body gives its budget back now.
            inner.end(py, &self.sh, &mut out, code, "peer sent GOAWAY", false);
        }
        Ok(PyList::new_bound(py, out))
    }

    /// HTTP/2 multiplexes: nothing waits on a previous response.
    fn resume<'py>(&self, py: Python<'py>) -> Bound<'py, PyList> {
        PyList::empty_bound(py)
    }

    /// Send response headers (no body yet).
    fn send_head(&self, py: Python<'_>, sid: u32, status: u16, headers: &Bound<'_, PyAny>) -> PyResult<()> {
        if self.sh.ended.get() {
            return Ok(());
        }
        let headers = parse_headers(py, headers)?;
        let mut inner = self.inner.borrow_mut();
        inner.send_head(py, &self.sh, sid, status, headers);
        inner.pump();
        Ok(())
    }

    /// Queue body bytes; they leave as the peer's flow-control windows allow.
    #[pyo3(signature = (sid, data, end=false))]
    fn send_data(&self, py: Python<'_>, sid: u32, data: &Bound<'_, PyAny>, end: bool) -> PyResult<()> {
        if self.sh.ended.get() {
            return Ok(());
        }
        {
            let inner = self.inner.borrow();
            match inner.streams.get(&sid) {
                Some(st) if !st.local_ended => {}
                _ => return Ok(()),
            }
        }
        let bytes: Bytes = if let Ok(b) = data.downcast::<PyBytes>() {
            Bytes::copy_from_slice(b.as_bytes())
        } else {
            let v: Vec<u8> = data.extract().map_err(|_| PyTypeError::new_err("data must be bytes-like"))?;
            Bytes::from(v)
        };
        let now = self.now(py);
        let mut out = Vec::new();
        {
            let mut inner = self.inner.borrow_mut();
            inner.send_data(py, &self.sh, now, sid, bytes, end);
        }
        self.finish(py, now, &mut out);
        Ok(())
    }

    /// RST_STREAM with ``error_code``; queued output for the stream is dropped.
    fn reset(&self, py: Python<'_>, sid: u32, error_code: u32) {
        let mut out = Vec::new();
        let mut inner = self.inner.borrow_mut();
        if self.sh.ended.get() {
            inner.forget(py, &self.sh, sid);
            return;
        }
        inner.pump();
        let Some(mut st) = inner.forget(py, &self.sh, sid) else { return };
        st.reset(error_code);
        drop(st);
        inner.pump();
        inner.drained(py, &self.sh, &mut out);
    }

    fn backlog(&self, sid: u32) -> u64 {
        self.inner.borrow().streams.get(&sid).map(|s| s.out_bytes).unwrap_or(0)
    }

    /// True when the stream's producer may queue more (below the low-water mark).
    fn writable(&self, sid: u32) -> bool {
        let inner = self.inner.borrow();
        inner.streams.get(&sid).map(|s| s.out_bytes).unwrap_or(0) <= inner.scan.lim.stream_buffer_low
    }

    fn is_open(&self, sid: u32) -> bool {
        self.inner.borrow().streams.contains_key(&sid)
    }

    /// Streams that still owe work (refused ones whose answer has gone out do not count).
    #[getter]
    fn open_streams(&self) -> usize {
        self.inner.borrow().streams.values().filter(|s| !(s.rejected && s.local_ended)).count()
    }

    /// Apply the slow-peer timeouts now (header, body and write timeouts; see the Python core).
    fn expire<'py>(&self, py: Python<'py>) -> Bound<'py, PyList> {
        let mut out = Vec::new();
        if self.sh.ended.get() {
            return PyList::empty_bound(py);
        }
        let now = self.now(py);
        {
            let mut inner = self.inner.borrow_mut();
            let lim = inner.scan.lim;
            if let Some(since) = inner.scan.block_since {
                if now - since > lim.header_timeout_s {
                    drop(inner);
                    self.sh.on_limit(py, "header_timeout_s");
                    self.inner.borrow_mut().end(py, &self.sh, &mut out, ENHANCE_YOUR_CALM, "header block not completed in time", true);
                    return PyList::new_bound(py, out);
                }
            }
            let sids: Vec<u32> = inner.streams.keys().copied().collect();
            for sid in sids {
                let Some(st) = inner.streams.get(&sid) else { continue };
                if let Some(stalled) = st.stalled_since {
                    if now - stalled > lim.write_timeout_s {
                        self.sh.on_limit(py, "write_timeout_s");
                        inner.pump();
                        if let Some(mut st) = inner.forget(py, &self.sh, sid) {
                            st.reset(CANCEL);
                            if st.accepted {
                                out.push(stream_aborted(py, sid, CANCEL));
                            }
                        }
                        continue;
                    }
                }
                if now - st.opened <= lim.body_timeout_s {
                    continue;
                }
                if st.accepted && !st.remote_ended {
                    self.sh.on_limit(py, "body_timeout_s");
                    inner.refuse_body(py, &self.sh, now, sid, 408, vec![("content-type".into(), "text/plain".into())],
                                      Bytes::from_static(b"request body not completed in time\n"), &mut out);
                } else if st.rejected {
                    let code = if st.local_ended { NO_ERROR } else { CANCEL };
                    inner.pump();
                    if let Some(mut st) = inner.forget(py, &self.sh, sid) {
                        st.reset(code);
                    }
                }
            }
        }
        self.finish(py, now, &mut out);
        PyList::new_bound(py, out)
    }

    fn ping(&self, py: Python<'_>) {
        if self.sh.ended.get() {
            return;
        }
        // Our own PING, after h2's pending output (h2's PingPong allows one user ping in flight; the
        // Python core sends one per call). h2 ignores the ACK of a PING it did not send.
        let mut inner = self.inner.borrow_mut();
        inner.pump();
        let mut frame = vec![0u8, 0, 8, 6, 0, 0, 0, 0, 0];
        frame.extend_from_slice(b"zerolayr");
        inner.bufs.borrow_mut().out.extend_from_slice(&frame);
        let _ = py;
    }

    /// Finish the open streams, refuse new ones (REFUSED_STREAM), then GOAWAY(NO_ERROR) and end once
    /// none is open: at once when none is.
    fn start_drain(&self, py: Python<'_>) {
        if self.sh.ended.get() || self.sh.draining.get() {
            return;
        }
        self.sh.draining.set(true);
        let mut inner = self.inner.borrow_mut();
        inner.drain_last = inner.scan.highest;
        let mut out = Vec::new();
        inner.drained(py, &self.sh, &mut out);
    }

    /// Final GOAWAY; nothing else will be sent.
    #[pyo3(signature = (error_code=NO_ERROR, reason="closed"))]
    fn close(&self, py: Python<'_>, error_code: u32, reason: &str) -> PyObject {
        let mut out = Vec::new();
        self.inner.borrow_mut().end(py, &self.sh, &mut out, error_code, reason, true);
        connection_ended(py, error_code, reason)
    }

    /// The transport wrote everything out: queued control answers have left.
    fn mark_flushed(&self) {
        self.inner.borrow_mut().scan.queued_control = 0;
    }

    /// The socket is gone: end without sending anything and give back every buffered body's budget.
    fn connection_lost(&self, py: Python<'_>) {
        self.sh.ended.set(true);
        let mut inner = self.inner.borrow_mut();
        let streams = std::mem::take(&mut inner.streams);
        for (_, st) in streams {
            self.sh.give(py, &st.owner, st.body.len());
        }
        inner.state = State::Done;
    }

    fn data_to_send<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let mut inner = self.inner.borrow_mut();
        if !self.sh.ended.get() {
            inner.pump();
        }
        let data = std::mem::take(&mut inner.bufs.borrow_mut().out);
        PyBytes::new_bound(py, &data)
    }
}

#[pymodule]
fn zerolayer_h2core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<H2Core>()?;
    m.add("H2_CRATE", "h2 0.4")?;
    let _ = PyString::new_bound(m.py(), "");
    Ok(())
}
