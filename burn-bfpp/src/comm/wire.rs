//! The byte format of [`MpiComm`](super::MpiComm) messages.
//!
//! Every message between processes is one MPI message of bytes on one MPI tag. Its header
//! says which logical stream it belongs to (a point-to-point tag, or collective number `seq`
//! of a group), which call sent it (so a receiver detects collectives called in different
//! orders) and carries the tensor as host values with the sender's dtype, so the receiving
//! side rebuilds exactly what [`LocalComm`](super::LocalComm) would hand over. Abort notices
//! travel in the same format so that they are drained by the same probe loop.
//!
//! All integers are little-endian; the format is private to processes of one build.

use burn::tensor::DType;

use super::host::{HostBuf, HostValues};
use super::{CommOp, Group, ReduceOp};

/// The logical stream a message belongs to; a receive waits on one `(source, stream)` pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Stream {
    /// Point-to-point tensors with this tag.
    P2p(u64),
    /// Collective number `seq` of a group.
    Collective(Group, u64),
    /// Opaque bytes with this tag (result gathering in multi-process runs).
    Bytes(u64),
}

/// What a data message carries.
#[derive(Debug, Clone)]
pub(crate) enum Payload {
    /// No value (barriers, non-root broadcast members).
    Empty,
    /// A tensor's values.
    Tensor(HostBuf),
    /// Opaque bytes.
    Bytes(Vec<u8>),
}

/// One decoded message.
#[derive(Debug, Clone)]
pub(crate) enum Message {
    /// A contribution to a stream.
    Data {
        /// Its stream.
        stream: Stream,
        /// The call that sent it.
        op: CommOp,
        /// Its content.
        payload: Payload,
    },
    /// World rank `rank` failed with `cause`; every receiver stops.
    Abort {
        /// The failed rank.
        rank: usize,
        /// Its error.
        cause: String,
    },
}

/// Appends little-endian integers and raw bytes.
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
}

/// Reads what [`Writer`] wrote; every read fails instead of panicking on short input.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "message truncated: needed {n} more bytes, {} left",
                self.0.len()
            ));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn usize(&mut self) -> Result<usize, String> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| format!("length {v} does not fit this machine"))
    }
}

fn group_code(g: Group) -> u8 {
    match g {
        Group::Pipeline => 0,
        Group::DataParallel => 1,
    }
}

fn group_of(code: u8) -> Result<Group, String> {
    match code {
        0 => Ok(Group::Pipeline),
        1 => Ok(Group::DataParallel),
        c => Err(format!("unknown group code {c}")),
    }
}

fn reduce_of(code: u8) -> Result<ReduceOp, String> {
    match code {
        0 => Ok(ReduceOp::Sum),
        1 => Ok(ReduceOp::Mean),
        c => Err(format!("unknown reduction code {c}")),
    }
}

fn reduce_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
    }
}

fn write_op(w: &mut Writer, op: CommOp) {
    // (variant, group, reduction, number): unused fields are 0.
    let (v, g, r, n) = match op {
        CommOp::Send { tag } => (0, 0, 0, tag),
        CommOp::Recv { tag } => (1, 0, 0, tag),
        CommOp::AllGather(g) => (2, group_code(g), 0, 0),
        CommOp::ReduceScatter(g, op) => (3, group_code(g), reduce_code(op), 0),
        CommOp::AllReduce(g, op) => (4, group_code(g), reduce_code(op), 0),
        CommOp::Broadcast(g, root) => (5, group_code(g), 0, root as u64),
        CommOp::Barrier(g) => (6, group_code(g), 0, 0),
    };
    w.u8(v);
    w.u8(g);
    w.u8(r);
    w.u64(n);
}

fn read_op(r: &mut Reader<'_>) -> Result<CommOp, String> {
    let (v, g, red, n) = (r.u8()?, r.u8()?, r.u8()?, r.u64()?);
    Ok(match v {
        0 => CommOp::Send { tag: n },
        1 => CommOp::Recv { tag: n },
        2 => CommOp::AllGather(group_of(g)?),
        3 => CommOp::ReduceScatter(group_of(g)?, reduce_of(red)?),
        4 => CommOp::AllReduce(group_of(g)?, reduce_of(red)?),
        5 => CommOp::Broadcast(
            group_of(g)?,
            usize::try_from(n).map_err(|_| format!("root {n} out of range"))?,
        ),
        6 => CommOp::Barrier(group_of(g)?),
        c => return Err(format!("unknown call code {c}")),
    })
}

fn dtype_code(d: DType) -> Result<u8, String> {
    match d {
        DType::F64 => Ok(0),
        DType::F32 => Ok(1),
        DType::Flex32 => Ok(2),
        DType::F16 => Ok(3),
        DType::BF16 => Ok(4),
        other => Err(format!(
            "cannot send {other:?} data; only float tensors travel"
        )),
    }
}

fn dtype_of(code: u8) -> Result<DType, String> {
    match code {
        0 => Ok(DType::F64),
        1 => Ok(DType::F32),
        2 => Ok(DType::Flex32),
        3 => Ok(DType::F16),
        4 => Ok(DType::BF16),
        c => Err(format!("unknown dtype code {c}")),
    }
}

/// Encodes a data message; fails only for a dtype that cannot travel.
pub(crate) fn encode_data(
    stream: Stream,
    op: CommOp,
    payload: &Payload,
) -> Result<Vec<u8>, String> {
    let mut w = Writer(Vec::new());
    w.u8(0);
    match stream {
        Stream::P2p(tag) => {
            w.u8(0);
            w.u8(0);
            w.u64(tag);
        }
        Stream::Collective(g, seq) => {
            w.u8(1);
            w.u8(group_code(g));
            w.u64(seq);
        }
        Stream::Bytes(tag) => {
            w.u8(2);
            w.u8(0);
            w.u64(tag);
        }
    }
    write_op(&mut w, op);
    match payload {
        Payload::Empty => w.u8(0),
        Payload::Tensor(buf) => {
            w.u8(1);
            w.u8(dtype_code(buf.dtype)?);
            w.u64(buf.shape.len() as u64);
            for &d in &buf.shape {
                w.u64(d as u64);
            }
            match &buf.values {
                HostValues::F32(v) => {
                    w.u8(0);
                    w.u64(v.len() as u64);
                    for x in v {
                        w.0.extend_from_slice(&x.to_le_bytes());
                    }
                }
                HostValues::F64(v) => {
                    w.u8(1);
                    w.u64(v.len() as u64);
                    for x in v {
                        w.0.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
        Payload::Bytes(bytes) => {
            w.u8(2);
            w.u64(bytes.len() as u64);
            w.0.extend_from_slice(bytes);
        }
    }
    Ok(w.0)
}

/// Encodes an abort notice.
pub(crate) fn encode_abort(rank: usize, cause: &str) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    w.u8(1);
    w.u64(rank as u64);
    w.0.extend_from_slice(cause.as_bytes());
    w.0
}

/// Decodes a message; the error says what is malformed.
pub(crate) fn decode(bytes: &[u8]) -> Result<Message, String> {
    let mut r = Reader(bytes);
    match r.u8()? {
        0 => {}
        1 => {
            let rank = r.usize()?;
            let cause = String::from_utf8_lossy(r.0).into_owned();
            return Ok(Message::Abort { rank, cause });
        }
        k => return Err(format!("unknown message kind {k}")),
    }
    let (kind, group, n) = (r.u8()?, r.u8()?, r.u64()?);
    let stream = match kind {
        0 => Stream::P2p(n),
        1 => Stream::Collective(group_of(group)?, n),
        2 => Stream::Bytes(n),
        k => return Err(format!("unknown stream kind {k}")),
    };
    let op = read_op(&mut r)?;
    let payload = match r.u8()? {
        0 => Payload::Empty,
        1 => {
            let dtype = dtype_of(r.u8()?)?;
            let rank = r.usize()?;
            let shape = (0..rank)
                .map(|_| r.usize())
                .collect::<Result<Vec<_>, _>>()?;
            let precision = r.u8()?;
            let len = r.usize()?;
            if len != shape.iter().product::<usize>() {
                return Err(format!("{len} values for shape {shape:?}"));
            }
            let values = match precision {
                0 => HostValues::F32(
                    r.take(len * 4)?
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ),
                1 => HostValues::F64(
                    r.take(len * 8)?
                        .chunks_exact(8)
                        .map(|c| {
                            let mut b = [0u8; 8];
                            b.copy_from_slice(c);
                            f64::from_le_bytes(b)
                        })
                        .collect(),
                ),
                p => return Err(format!("unknown precision code {p}")),
            };
            Payload::Tensor(HostBuf {
                shape,
                dtype,
                values,
            })
        }
        2 => {
            let len = r.usize()?;
            Payload::Bytes(r.take(len)?.to_vec())
        }
        p => return Err(format!("unknown payload kind {p}")),
    };
    Ok(Message::Data {
        stream,
        op,
        payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_bit_for_bit() {
        let buf = HostBuf {
            shape: vec![2, 2],
            dtype: DType::BF16,
            values: HostValues::F32(vec![1.5, -0.0, f32::MIN_POSITIVE, 3.0]),
        };
        let ops = [
            CommOp::Send { tag: u64::MAX },
            CommOp::ReduceScatter(Group::DataParallel, ReduceOp::Mean),
            CommOp::Broadcast(Group::Pipeline, 3),
        ];
        for op in ops {
            let stream = Stream::Collective(Group::DataParallel, 41);
            let bytes = encode_data(stream, op, &Payload::Tensor(buf.clone())).expect("float");
            let Message::Data {
                stream: s,
                op: o,
                payload: Payload::Tensor(b),
            } = decode(&bytes).expect("valid")
            else {
                panic!("wrong message kind");
            };
            assert_eq!((s, o), (stream, op));
            assert_eq!((b.shape, b.dtype), (vec![2, 2], DType::BF16));
            match b.values {
                HostValues::F32(v) => {
                    let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
                    let want: Vec<u32> = [1.5f32, -0.0, f32::MIN_POSITIVE, 3.0]
                        .iter()
                        .map(|x| x.to_bits())
                        .collect();
                    assert_eq!(bits, want);
                }
                HostValues::F64(_) => panic!("precision changed"),
            }
        }
        match decode(&encode_abort(3, "boom")).expect("valid") {
            Message::Abort { rank, cause } => assert_eq!((rank, cause.as_str()), (3, "boom")),
            Message::Data { .. } => panic!("abort decoded as data"),
        }
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        let bytes = encode_data(
            Stream::Bytes(1),
            CommOp::Send { tag: 1 },
            &Payload::Bytes(vec![1, 2, 3]),
        )
        .expect("bytes");
        for cut in 0..bytes.len() {
            assert!(
                decode(&bytes[..cut]).is_err(),
                "prefix of {cut} bytes decoded"
            );
        }
        let ints = HostBuf {
            shape: vec![1],
            dtype: DType::I32,
            values: HostValues::F32(vec![1.0]),
        };
        assert!(encode_data(
            Stream::P2p(0),
            CommOp::Send { tag: 0 },
            &Payload::Tensor(ints)
        )
        .is_err());
    }
}
