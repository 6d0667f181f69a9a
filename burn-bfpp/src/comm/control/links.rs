//! The control plane's connections and what travels on them: every frame names its kind, and
//! a message its sender and receiver, so any rank can pass it on towards the receiver along
//! the [tree](super::tree). Each connection has a reader thread, which delivers the frames
//! meant for this rank, forwards the others and turns the end of the connection into loss
//! notices, and a writer thread, so that posting never blocks on a slow peer.
//!
//! A rank learns that another is gone in two ways, both passed on to every rank (flooded
//! along the tree, each notice once):
//!
//! * **finished**: the rank's own transport was dropped; it posts nothing more, but it still
//!   forwards until its children have finished too (see [`super::ControlTransport`]'s drop);
//! * **cut**: a connection ended (the process exited or crashed): the rank at its far end, and
//!   every rank the tree reached only through it, cannot be reached any more.
//!
//! Either becomes [`Incoming::Lost`] for each rank concerned, delivered after every message
//! that rank sent along the same path, so a wait on it fails at once with everything it sent
//! received first.

use std::collections::HashSet;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};

use super::super::process::Incoming;
use super::tree::Tree;

/// Largest frame accepted (a corrupted length must not allocate the machine's memory).
const MAX_FRAME: u64 = 1 << 40;

/// Frame kinds: a message (sender, receiver, bytes), and the two kinds of loss notice.
const DATA: u8 = 0;
const FINISHED: u8 = 1;
const CUT: u8 = 2;

/// Kind, then two ranks (little-endian u32): sender and receiver, or the rank concerned.
const HEADER: usize = 9;

/// The reason given for a rank whose transport was dropped, as a closed connection reads.
pub(super) const CLOSED: &str = "its process closed the connection";

/// A frame's body: kind, two ranks, payload.
fn frame(kind: u8, a: usize, b: usize, payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(HEADER + payload.len());
    body.push(kind);
    // World sizes are far below u32::MAX (checked at connect).
    body.extend_from_slice(&(a as u32).to_le_bytes());
    body.extend_from_slice(&(b as u32).to_le_bytes());
    body.extend_from_slice(payload);
    body
}

/// The kind and the two ranks of a frame's body.
fn header(body: &[u8], size: usize) -> Result<(u8, usize, usize), String> {
    if body.len() < HEADER {
        return Err(format!(
            "it sent a frame of {} bytes, shorter than a header",
            body.len()
        ));
    }
    let rank = |at: usize| {
        let mut bytes = [0u8; 4];
        bytes.copy_from_slice(&body[at..at + 4]);
        u32::from_le_bytes(bytes) as usize
    };
    let (a, b) = (rank(1), rank(5));
    if body[0] > CUT || a >= size || (body[0] == DATA && b >= size) {
        return Err(format!(
            "it sent a malformed frame (kind {}, ranks {a} and {b} in a world of {size})",
            body[0]
        ));
    }
    Ok((body[0], a, b))
}

/// What this rank knows of the ranks that are gone.
#[derive(Default)]
struct Gone {
    /// Ranks reported to this rank's inbox as lost.
    reported: HashSet<usize>,
    /// Ranks whose finished notice was passed on.
    finished: HashSet<usize>,
    /// Ranks whose cut notice was passed on.
    cut: HashSet<usize>,
}

/// Routes frames between this rank's connections and its inbox; shared by the reader
/// threads and the transport.
pub(super) struct Router {
    tree: Tree,
    /// The writer queue of each neighbour; emptied when the transport closes.
    queues: Mutex<Vec<(usize, Sender<Vec<u8>>)>>,
    /// Frames queued and not yet written (this rank's own and those it forwards).
    in_flight: AtomicUsize,
    /// This rank's inbox.
    events: Mutex<Sender<Incoming>>,
    gone: Mutex<Gone>,
    /// Children whose connection is still open: this rank forwards for them until it ends.
    open_children: AtomicUsize,
}

/// Locks `m`; a panic elsewhere cannot leave these sets or queues half-updated.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Router {
    /// Starts a reader and a writer thread for each connection (`(neighbour, stream)`), all
    /// delivering into `events`.
    pub(super) fn start(
        tree: Tree,
        links: Vec<(usize, TcpStream)>,
        events: Sender<Incoming>,
    ) -> Result<(Arc<Router>, Vec<TcpStream>), String> {
        let children = links
            .iter()
            .filter(|(n, _)| tree.children().contains(n))
            .count();
        let router = Arc::new(Router {
            tree,
            queues: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            events: Mutex::new(events),
            gone: Mutex::default(),
            open_children: AtomicUsize::new(children),
        });
        let mut sockets = Vec::new();
        let mut readers = Vec::new();
        for (peer, stream) in links {
            let clone = |s: &TcpStream| {
                s.try_clone()
                    .map_err(|e| format!("connection to rank {peer}: {e}"))
            };
            // Frames are small and latency-bound (barriers, abort notices).
            stream
                .set_nodelay(true)
                .and_then(|()| stream.set_nonblocking(false))
                .and_then(|()| stream.set_read_timeout(None))
                .map_err(|e| format!("connection to rank {peer}: {e}"))?;
            let (reader, writer) = (clone(&stream)?, clone(&stream)?);
            sockets.push(stream);
            let (queue, frames) = std::sync::mpsc::channel::<Vec<u8>>();
            lock(&router.queues).push((peer, queue));
            let shared = Arc::clone(&router);
            std::thread::spawn(move || write_frames(writer, frames, shared));
            readers.push((peer, reader));
        }
        // Readers start once every queue exists: the first frame may need any of them.
        for (peer, reader) in readers {
            let shared = Arc::clone(&router);
            std::thread::spawn(move || read_frames(peer, reader, shared));
        }
        Ok((router, sockets))
    }

    /// Sends `bytes` from this rank to `peer`: into its own inbox if `peer` is this rank.
    pub(super) fn post(&self, peer: usize, bytes: Vec<u8>) {
        let rank = self.tree.rank;
        if peer == rank {
            self.deliver(Incoming::Message { from: rank, bytes });
            return;
        }
        let body = frame(DATA, rank, peer, &bytes);
        self.send(self.tree.next_hop(peer), body);
    }

    /// Tells every rank that this one posts nothing more.
    pub(super) fn announce_finished(&self) {
        let rank = self.tree.rank;
        lock(&self.gone).finished.insert(rank);
        self.flood(None, &frame(FINISHED, rank, 0, &[]));
    }

    /// Frames queued and not yet written.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Children whose connection has not ended.
    pub(super) fn open_children(&self) -> usize {
        self.open_children.load(Ordering::Acquire)
    }

    /// Drops the writer queues: each writer thread ends once it has written what it holds.
    pub(super) fn close(&self) {
        lock(&self.queues).clear();
    }

    fn send(&self, neighbour: usize, body: Vec<u8>) {
        let queues = lock(&self.queues);
        // No queue: the transport closed, or the neighbour's connection was given up.
        if let Some((_, queue)) = queues.iter().find(|(n, _)| *n == neighbour) {
            self.in_flight.fetch_add(1, Ordering::AcqRel);
            if queue.send(body).is_err() {
                self.in_flight.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Passes a notice on to every neighbour but the one it came from.
    fn flood(&self, from: Option<usize>, body: &[u8]) {
        for n in self.tree.neighbours() {
            if Some(n) != from {
                self.send(n, body.to_vec());
            }
        }
    }

    fn deliver(&self, incoming: Incoming) {
        // A closed inbox: this rank's transport is gone and needs nothing more.
        let _ = lock(&self.events).send(incoming);
    }

    /// Reports `rank` lost to this rank's inbox, once.
    fn report(&self, rank: usize, reason: String) {
        if lock(&self.gone).reported.insert(rank) {
            self.deliver(Incoming::Lost { from: rank, reason });
        }
    }

    /// A frame from the neighbour `link`: delivered, forwarded, or a notice acted on.
    fn arrived(&self, link: usize, body: Vec<u8>) -> Result<(), String> {
        let (kind, a, b) = header(&body, self.tree.size)?;
        match kind {
            DATA if b == self.tree.rank => self.deliver(Incoming::Message {
                from: a,
                bytes: body[HEADER..].to_vec(),
            }),
            DATA => self.send(self.tree.next_hop(b), body),
            FINISHED => {
                if lock(&self.gone).finished.insert(a) {
                    self.report(a, CLOSED.to_string());
                    self.flood(Some(link), &body);
                }
            }
            _ => {
                let reason = String::from_utf8_lossy(&body[HEADER..]).into_owned();
                self.cut_off(a, &reason, Some(link));
            }
        }
        Ok(())
    }

    /// Rank `via` cannot be reached any more (`reason`): it and every rank behind it are
    /// reported lost, and the notice passed on (not back to `link`, where it came from).
    fn cut_off(&self, via: usize, reason: &str, link: Option<usize>) {
        if !lock(&self.gone).cut.insert(via) {
            return;
        }
        for r in (0..self.tree.size).filter(|&r| self.tree.reached_through(via, r)) {
            let why = if r == via {
                reason.to_string()
            } else {
                format!(
                    "the control plane reaches it only through rank {via}, which is gone \
                     ({reason})"
                )
            };
            self.report(r, why);
        }
        self.flood(link, &frame(CUT, via, 0, reason.as_bytes()));
    }

    /// The connection to the neighbour `peer` ended.
    fn link_ended(&self, peer: usize, reason: &str) {
        if self.tree.children().contains(&peer) {
            self.open_children.fetch_sub(1, Ordering::AcqRel);
        }
        self.cut_off(peer, reason, Some(peer));
    }
}

/// Reader thread: every frame from the neighbour `peer` is delivered or passed on; the end of
/// the connection cuts off what lies behind it.
fn read_frames(peer: usize, stream: TcpStream, router: Arc<Router>) {
    let mut reader = BufReader::new(stream);
    let reason = loop {
        let mut len = [0u8; 8];
        if let Err(e) = reader.read_exact(&mut len) {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                CLOSED.to_string()
            } else {
                format!("reading from its connection: {e}")
            };
        }
        let len = u64::from_le_bytes(len);
        if len > MAX_FRAME {
            break format!("it sent a frame of {len} bytes (corrupted stream?)");
        }
        let mut body = vec![0u8; len as usize];
        if let Err(e) = reader.read_exact(&mut body) {
            break format!("its connection ended inside a message: {e}");
        }
        if let Err(reason) = router.arrived(peer, body) {
            break reason;
        }
    };
    router.link_ended(peer, &reason);
}

/// Writer thread: writes the queued frames in order, flushing whenever its queue is empty (so
/// a burst leaves in few writes); a frame counts as in flight until flushed. After a write
/// error (the peer is gone) the rest are dropped; the reader side reports the loss.
fn write_frames(stream: TcpStream, frames: Receiver<Vec<u8>>, router: Arc<Router>) {
    use std::sync::mpsc::TryRecvError;
    let mut writer = BufWriter::new(stream);
    let mut broken = false;
    let mut unflushed = 0;
    loop {
        let body = match frames.try_recv() {
            Ok(body) => body,
            Err(waiting) => {
                if unflushed > 0 {
                    broken |= writer.flush().is_err();
                    router.in_flight.fetch_sub(unflushed, Ordering::AcqRel);
                    unflushed = 0;
                }
                if waiting == TryRecvError::Disconnected {
                    return;
                }
                match frames.recv() {
                    Ok(body) => body,
                    Err(_) => return,
                }
            }
        };
        if !broken {
            let len = (body.len() as u64).to_le_bytes();
            broken = writer
                .write_all(&len)
                .and_then(|()| writer.write_all(&body))
                .is_err();
        }
        unflushed += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_headers_are_named() {
        assert!(header(&[DATA, 0, 0], 4).unwrap_err().contains("shorter"));
        let to_rank_9 = frame(DATA, 1, 9, b"x");
        assert!(header(&to_rank_9, 4).unwrap_err().contains("malformed"));
        assert!(header(&frame(7, 1, 2, &[]), 4).is_err());
        assert_eq!(header(&frame(CUT, 3, 0, b"why"), 4), Ok((CUT, 3, 0)));
    }
}
