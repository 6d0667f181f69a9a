//! Faults injected into a training run on purpose (`BFPP_FAULT_INJECT`), so that the tests can
//! check a failing rank ends every rank with its failure named.
//!
//! Only a build with the test-only feature `fault-injection` injects them (the tests build
//! with it, `cargo build` without). A build without it refuses a set `BFPP_FAULT_INJECT`,
//! naming the feature, rather than train as if nothing had been asked.

#[cfg(feature = "fault-injection")]
use std::time::Duration;

#[cfg(feature = "fault-injection")]
pub use burn_bfpp::engine::Fault;
#[cfg(feature = "fault-injection")]
use burn_bfpp::engine::FaultKind;
use burn_bfpp::engine::Trainer;

use super::error::TrainError;

/// The environment variable that injects a fault:
/// `rank=R,step=S[,kind=error|panic|nan|sleep|abort][,secs=T]` (`secs` goes with `kind=sleep`).
pub const FAULT_ENV: &str = "BFPP_FAULT_INJECT";

/// A fault to inject; none can be in a build without the feature `fault-injection`.
#[cfg(not(feature = "fault-injection"))]
#[derive(Debug, Clone, Copy)]
pub enum Fault {}

/// Parses `rank=R,step=S[,kind=error|panic|nan|sleep|abort][,secs=T]` (the step is 1-based, like
/// the engine's; `kind` defaults to `error`; `sleep` needs `secs`, the others refuse it).
#[cfg(feature = "fault-injection")]
pub fn parse_fault(text: &str) -> Result<Fault, TrainError> {
    const FORMAT: &str =
        "expected `rank=R,step=S[,kind=error|panic|nan|sleep|abort][,secs=T]` with \
                          S >= 1 (secs only with kind=sleep), e.g. `rank=1,step=2,kind=panic` \
                          or `rank=1,step=2,kind=sleep,secs=5`";
    let bad = |why: String| TrainError::Fault(format!("{FAULT_ENV}: {why}; {FORMAT}"));
    let (mut rank, mut step, mut kind, mut secs) = (None, None, "error", None);
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
        let value = value.trim();
        let number = || {
            value
                .parse::<usize>()
                .map_err(|_| bad(format!("{key} = `{value}` is not a non-negative integer")))
        };
        match key.trim() {
            "rank" => rank = Some(number()?),
            "step" => step = Some(number()?),
            "kind" => {
                kind = match value {
                    "error" | "panic" | "nan" | "sleep" | "abort" => value,
                    other => return Err(bad(format!("unknown kind `{other}`"))),
                }
            }
            "secs" => match value.parse::<f64>() {
                Ok(t) if t.is_finite() && t >= 0.0 => secs = Some(t),
                _ => return Err(bad(format!("secs = `{value}` is not a number of seconds"))),
            },
            other => return Err(bad(format!("unknown key `{other}`"))),
        }
    }
    let kind = match (kind, secs) {
        ("sleep", Some(t)) => FaultKind::Sleep(Duration::from_secs_f64(t)),
        ("sleep", None) => return Err(bad("kind=sleep needs secs=T".into())),
        (other, Some(_)) => return Err(bad(format!("secs goes with kind=sleep, not {other}"))),
        ("panic", None) => FaultKind::Panic,
        ("nan", None) => FaultKind::NonFinite,
        ("abort", None) => FaultKind::Abort,
        _ => FaultKind::Error,
    };
    match (rank, step) {
        (Some(rank), Some(step)) if step >= 1 => Ok(Fault { rank, step, kind }),
        (Some(_), Some(_)) => Err(bad("step 0 is not an optimizer step".into())),
        _ => Err(bad(format!("`{text}` lacks rank or step"))),
    }
}

/// The fault from the environment, if the variable is set (and not empty), checked against a
/// world of `world_size` ranks. Without the feature `fault-injection`, a set variable is an
/// error naming the feature.
pub fn fault_from_env(world_size: usize) -> Result<Option<Fault>, TrainError> {
    let text = match std::env::var(FAULT_ENV) {
        Ok(text) if !text.trim().is_empty() => text,
        Ok(_) | Err(std::env::VarError::NotPresent) => return Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(TrainError::Fault(format!(
                "{FAULT_ENV}: the value is not valid UTF-8"
            )))
        }
    };
    #[cfg(feature = "fault-injection")]
    {
        let fault = parse_fault(&text)?;
        if fault.rank >= world_size {
            return Err(TrainError::Fault(format!(
                "{FAULT_ENV}: rank {} does not exist: pp × dp = {world_size} ranks (0..={}); \
                 pick a rank below {world_size}",
                fault.rank,
                world_size.saturating_sub(1)
            )));
        }
        Ok(Some(fault))
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = world_size;
        Err(TrainError::Fault(format!(
            "{FAULT_ENV} is set (`{}`), but this build of bfpp has no fault injection, a \
             test-only feature: build with `--features fault-injection` (the tests do), or \
             unset {FAULT_ENV}",
            text.trim()
        )))
    }
}

/// `trainer` with `fault` injected, if there is one.
pub fn inject<W>(trainer: Trainer<'_, W>, fault: Option<Fault>) -> Trainer<'_, W> {
    match fault {
        #[cfg(feature = "fault-injection")]
        Some(fault) => trainer.inject_fault(fault),
        #[cfg(not(feature = "fault-injection"))]
        Some(fault) => match fault {},
        None => trainer,
    }
}

#[cfg(all(test, feature = "fault-injection"))]
mod tests {
    use super::*;

    #[test]
    fn faults_parse() {
        let f = parse_fault("rank=1,step=3").expect("valid");
        assert_eq!((f.rank, f.step, f.kind), (1, 3, FaultKind::Error));
        let kind = |text: &str| parse_fault(text).expect(text).kind;
        assert_eq!(kind(" rank = 0 , step=1, kind=panic "), FaultKind::Panic);
        assert_eq!(kind("rank=0,step=1,kind=nan"), FaultKind::NonFinite);
        assert_eq!(
            kind("rank=0,step=1,kind=sleep,secs=2.5"),
            FaultKind::Sleep(Duration::from_millis(2500))
        );
        for bad in [
            "",
            "rank=1",
            "rank=1,step=0",
            "rank=x,step=1",
            "rank=1,step=1,kind=boom",
            "rank=1,step=1,when=now",
            "rank1,step=1",
            "rank=1,step=1,kind=sleep",
            "rank=1,step=1,kind=nan,secs=1",
            "rank=1,step=1,kind=sleep,secs=-1",
            "rank=1,step=1,kind=sleep,secs=soon",
        ] {
            let err = parse_fault(bad).expect_err(bad).to_string();
            assert!(err.contains("rank=R,step=S"), "{bad}: {err}");
        }
    }
}
