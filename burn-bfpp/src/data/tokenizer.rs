//! The byte-level tokenizer: every byte is its own token.
//!
//! Byte-level tokenization needs no training, no vocabulary file and no unknown-token case,
//! and it accepts any input — including files that are not valid UTF-8 — so the data pipeline
//! never has to reject or rewrite a corpus.

/// Number of distinct tokens: one per byte value.
pub const VOCAB_SIZE: usize = 256;

/// Maps text to token ids (byte values) and back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Number of distinct token ids, [`VOCAB_SIZE`].
    pub fn vocab_size(&self) -> usize {
        VOCAB_SIZE
    }

    /// The token ids of `text`'s UTF-8 bytes.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_bytes(text.as_bytes())
    }

    /// The token ids of arbitrary bytes.
    pub fn encode_bytes(&self, bytes: &[u8]) -> Vec<u32> {
        bytes.iter().map(|&b| u32::from(b)).collect()
    }

    /// The bytes of `ids`, or `None` if an id is not a byte (`>= 256`), which only a model
    /// with a larger vocabulary can produce.
    pub fn decode_bytes(&self, ids: &[u32]) -> Option<Vec<u8>> {
        ids.iter().map(|&id| u8::try_from(id).ok()).collect()
    }

    /// The text of `ids`. Invalid UTF-8 (a model may emit a partial multi-byte character)
    /// becomes U+FFFD and ids `>= 256` become `?`, so sampling output can always be printed.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .map(|&id| u8::try_from(id).unwrap_or(b'?'))
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_ascii_and_multibyte() {
        let t = ByteTokenizer;
        for text in ["", "hello, world\n", "naïve café ☕ — 日本語"] {
            let ids = t.encode(text);
            assert_eq!(ids.len(), text.len());
            assert!(ids.iter().all(|&id| (id as usize) < t.vocab_size()));
            assert_eq!(t.decode(&ids), text);
            assert_eq!(t.decode_bytes(&ids).as_deref(), Some(text.as_bytes()));
        }
    }

    #[test]
    fn arbitrary_bytes_round_trip_and_bad_ids_are_visible() {
        let t = ByteTokenizer;
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(t.decode_bytes(&t.encode_bytes(&bytes)), Some(bytes));
        assert_eq!(t.decode_bytes(&[65, 300]), None);
        assert_eq!(t.decode(&[65, 300]), "A?");
        assert_eq!(t.decode(&[0xE2]), "\u{FFFD}");
    }
}
