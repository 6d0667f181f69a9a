//! The job's secret: what every connection to a rank's listeners (the rendezvous store, the
//! control channel) must prove it knows, so that a program on the network that is not a rank
//! of this job cannot read or write the store or pose as a rank.
//!
//! The secret never crosses the network: a listener sends each new connection a fresh random
//! challenge, and the connecting side answers with HMAC-SHA256 of the challenge under the
//! secret (and what the connection is for, so that an answer to one listener is worth nothing
//! at another). `bfpp launch` makes a secret per job and hands it to its processes in
//! [`JOB_SECRET_ENV`]; under torchrun or srun every process reads it from there, so the job
//! script exports it (`export BFPP_JOB_SECRET=$(openssl rand -hex 32)`).

use std::fmt;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The environment variable that carries the job's secret to every process.
pub const JOB_SECRET_ENV: &str = "BFPP_JOB_SECRET";

/// Shortest secret accepted, in bytes: 128 bits written as hex.
const MIN_SECRET_BYTES: usize = 32;

/// Bytes of a challenge.
const CHALLENGE_BYTES: usize = 16;

/// Bytes of an answer (HMAC-SHA256).
pub(crate) const ANSWER_BYTES: usize = 32;

/// Longest wait for the answer to a challenge: the other side sends it at once. (The wait for
/// a challenge is the caller's: a rank's listener may accept only once it has connected to
/// its own peers.)
pub(crate) const HANDSHAKE_WAIT: Duration = Duration::from_secs(5);

/// The secret of one job, shared by all its processes.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret(Vec<u8>);

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

impl JobSecret {
    /// A new random secret (64 hex digits), for a launcher to hand to the processes it starts.
    pub fn generate() -> std::io::Result<Self> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(JobSecret(hex.into_bytes()))
    }

    /// The secret in `text` (as found in [`JOB_SECRET_ENV`]), refused when it is too short to
    /// be a secret.
    pub fn from_text(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "{JOB_SECRET_ENV} has {} characters, fewer than {MIN_SECRET_BYTES}: give every \
                 process of the job the same random value, e.g. `export \
                 {JOB_SECRET_ENV}=$(openssl rand -hex 32)` in the job script",
                text.len()
            ));
        }
        Ok(JobSecret(text.as_bytes().to_vec()))
    }

    /// One secret for every rank of a test's job.
    #[cfg(test)]
    pub(crate) fn for_tests() -> Self {
        JobSecret(b"a-test-secret-shared-by-the-ranks-of-one-test-job".to_vec())
    }

    /// The text to put in [`JOB_SECRET_ENV`] for the processes of this job.
    pub fn to_text(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    /// The answer to `challenge` at the listener for `purpose`.
    fn answer(&self, purpose: &[u8], challenge: &[u8]) -> Hmac<Sha256> {
        // HMAC takes keys of any length.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
        mac.update(purpose);
        mac.update(&[0]);
        mac.update(challenge);
        mac
    }

    /// Listener side: sends a fresh challenge on `stream` and checks the answer that comes
    /// back within a few seconds; `Err` says why the connection is not one of this job's.
    pub(crate) fn challenge(&self, stream: &mut TcpStream, purpose: &[u8]) -> Result<(), String> {
        let mut challenge = [0u8; CHALLENGE_BYTES];
        getrandom::fill(&mut challenge).map_err(|e| format!("no randomness: {e}"))?;
        stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(HANDSHAKE_WAIT)))
            .and_then(|()| stream.write_all(&challenge))
            .map_err(|e| format!("sending the challenge: {e}"))?;
        let mut answer = [0u8; ANSWER_BYTES];
        stream
            .read_exact(&mut answer)
            .map_err(|e| format!("no answer to the challenge: {e}"))?;
        self.answer(purpose, &challenge)
            .verify_slice(&answer)
            .map_err(|_| {
                format!("a wrong answer to the challenge (not this job's {JOB_SECRET_ENV})")
            })?;
        stream
            .set_read_timeout(None)
            .map_err(|e| format!("after the challenge: {e}"))
    }

    /// Connecting side: reads the listener's challenge from `stream`, waiting at most `wait`,
    /// and returns the answer to send.
    pub(crate) fn respond(
        &self,
        stream: &mut TcpStream,
        purpose: &[u8],
        wait: Duration,
    ) -> std::io::Result<[u8; ANSWER_BYTES]> {
        stream.set_read_timeout(Some(wait.max(Duration::from_millis(100))))?;
        let mut challenge = [0u8; CHALLENGE_BYTES];
        stream.read_exact(&mut challenge)?;
        stream.set_read_timeout(None)?;
        Ok(self
            .answer(purpose, &challenge)
            .finalize()
            .into_bytes()
            .into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_random_long_enough_and_never_printed() {
        let (a, b) = (
            JobSecret::generate().expect("random"),
            JobSecret::generate().expect("random"),
        );
        assert_ne!(a, b);
        assert_eq!(a.to_text().len(), 64);
        assert_eq!(JobSecret::from_text(&a.to_text()).expect("valid"), a);
        assert_eq!(format!("{a:?}"), "JobSecret(..)");
        let short = JobSecret::from_text("hunter2").expect_err("too short");
        assert!(
            short.contains(JOB_SECRET_ENV) && short.contains("openssl rand"),
            "{short}"
        );
    }

    #[test]
    fn only_the_same_secret_and_purpose_answer_a_challenge() {
        let secret = JobSecret::generate().expect("random");
        let other = JobSecret::generate().expect("random");
        let challenge = [7u8; CHALLENGE_BYTES];
        let good = secret.answer(b"store", &challenge).finalize().into_bytes();
        assert!(secret
            .answer(b"store", &challenge)
            .verify_slice(&good)
            .is_ok());
        assert!(other
            .answer(b"store", &challenge)
            .verify_slice(&good)
            .is_err());
        assert!(secret
            .answer(b"control", &challenge)
            .verify_slice(&good)
            .is_err());
        assert!(secret
            .answer(b"store", &[8u8; CHALLENGE_BYTES])
            .verify_slice(&good)
            .is_err());
    }
}
