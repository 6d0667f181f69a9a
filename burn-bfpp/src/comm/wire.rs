//! The messages of a [`ProcessComm`](super::ProcessComm) and their bytes.
//!
//! Every message between processes is one transport message of bytes. Its header says which
//! logical stream it belongs to (a point-to-point tag, or round `round` of collective number
//! `seq` of a group), which call sent it (so a receiver detects collectives called in
//! different orders) and carries the tensor as Burn's own [`TensorData`], in the sender's
//! dtype: a bf16 value travels as 2 bytes. Abort notices travel in the same format so that
//! they are drained by the same probe loop.
//!
//! The encoding is postcard's (serde), not a format of ours: compact, versioned with the
//! crate, and it fails on malformed input instead of panicking. The format is private to the
//! processes of one build.

use burn::tensor::TensorData;
use serde::{Deserialize, Serialize};

use super::{CommOp, Group};

/// The logical stream a message belongs to; a receive waits on one `(source, stream)` pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) enum Stream {
    /// Point-to-point tensors with this tag.
    P2p(u64),
    /// Round `round` (third field) of collective number `seq` (second field) of a group.
    Collective(Group, u64, u8),
    /// Opaque bytes with this tag (result gathering in multi-process runs).
    Bytes(u64),
}

/// What a data message carries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Payload {
    /// No value (barriers, non-root broadcast members).
    Empty,
    /// A point-to-point or broadcast tensor, in its dtype.
    Tensor(TensorData),
    /// A part of a collective contribution: the sender's input shape, and the part's values
    /// (1-D, in the input's dtype).
    Part {
        /// The shape of the sender's whole input.
        shape: Vec<usize>,
        /// The elements sent.
        data: TensorData,
    },
    /// Opaque bytes.
    Bytes(Vec<u8>),
}

/// One message.
#[derive(Debug, Clone, Serialize, Deserialize)]
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

/// Encodes a data message.
pub(crate) fn encode_data(stream: Stream, op: CommOp, payload: Payload) -> Result<Vec<u8>, String> {
    let message = Message::Data {
        stream,
        op,
        payload,
    };
    postcard::to_allocvec(&message).map_err(|e| format!("encoding a message: {e}"))
}

/// Encodes an abort notice.
pub(crate) fn encode_abort(rank: usize, cause: &str) -> Vec<u8> {
    let message = Message::Abort {
        rank,
        cause: cause.to_string(),
    };
    // Integers and a string always encode; a failure here would be postcard's bug.
    postcard::to_allocvec(&message).unwrap_or_default()
}

/// Decodes a message; the error says what is malformed.
pub(crate) fn decode(bytes: &[u8]) -> Result<Message, String> {
    let message: Message =
        postcard::from_bytes(bytes).map_err(|e| format!("malformed message: {e}"))?;
    if let Message::Data {
        payload: Payload::Tensor(data) | Payload::Part { data, .. },
        ..
    } = &message
    {
        check_data(data)?;
    }
    Ok(message)
}

/// Fails unless `data` holds exactly its shape's values in its dtype (what a tensor built
/// from it assumes).
fn check_data(data: &TensorData) -> Result<(), String> {
    let expected = data.shape.num_elements() * data.dtype.size();
    if data.bytes.len() != expected || !data.dtype.is_float() {
        return Err(format!(
            "malformed tensor: {} bytes of {:?} for shape {:?} (expected {expected} bytes of a \
             float dtype)",
            data.bytes.len(),
            data.dtype,
            data.shape.as_slice()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use burn::tensor::DType;

    use super::*;
    use crate::comm::ReduceOp;

    #[test]
    fn messages_round_trip_bit_for_bit_in_their_dtype() {
        let values = [1.5f32, -0.0, f32::MIN_POSITIVE, 3.0];
        let data = TensorData::new(values.to_vec(), [2, 2]).convert_dtype(DType::BF16);
        let ops = [
            CommOp::Send { tag: u64::MAX },
            CommOp::ReduceScatter(Group::DataParallel, ReduceOp::Mean),
            CommOp::Broadcast(Group::Pipeline, 3),
        ];
        for op in ops {
            let stream = Stream::Collective(Group::DataParallel, 41, 1);
            let bytes = encode_data(stream, op, Payload::Tensor(data.clone())).expect("encodes");
            // bf16 travels as 2 bytes a value: 4 values and a small header.
            assert!(bytes.len() < 8 + 40, "{} bytes", bytes.len());
            let Message::Data {
                stream: s,
                op: o,
                payload: Payload::Tensor(d),
            } = decode(&bytes).expect("valid")
            else {
                panic!("wrong message kind");
            };
            assert_eq!((s, o), (stream, op));
            assert_eq!(d, data);
        }
        match decode(&encode_abort(3, "boom")).expect("valid") {
            Message::Abort { rank, cause } => assert_eq!((rank, cause.as_str()), (3, "boom")),
            Message::Data { .. } => panic!("abort decoded as data"),
        }
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        let data = TensorData::new(vec![1.0f32, 2.0, 3.0], [3]);
        let bytes = encode_data(
            Stream::P2p(1),
            CommOp::Send { tag: 1 },
            Payload::Part {
                shape: vec![6],
                data,
            },
        )
        .expect("encodes");
        for cut in 0..bytes.len() {
            assert!(
                decode(&bytes[..cut]).is_err(),
                "prefix of {cut} bytes decoded"
            );
        }
        // Integers are not what collectives and transfers carry.
        let ints = TensorData::new(vec![1i32], [1]);
        let bytes = encode_data(
            Stream::P2p(0),
            CommOp::Send { tag: 0 },
            Payload::Tensor(ints),
        )
        .expect("encodes");
        assert!(decode(&bytes).expect_err("ints").contains("float"));
    }
}
