//! Where a command's results go: standard output or a file, and errors to standard error.

use std::io::{self, Write};
use std::path::Path;

use super::error::CliError;

/// Print `error: ...` on standard error (ignoring a closed standard error).
pub fn report_error(err: &CliError) {
    // One write: standard error is unbuffered, and ranks that are processes share it, so a
    // line written in pieces would interleave with the other ranks' lines.
    let line = format!("error: {}\n", err.to_string().trim_end());
    let _ = io::stderr().lock().write_all(line.as_bytes());
}

/// Write `text` to `path`, or to standard output when there is none. A reader that closes
/// the pipe early (`bfpp schedule | head`) is not an error.
pub fn write_output(path: Option<&Path>, text: &str) -> Result<(), CliError> {
    match path {
        Some(path) => std::fs::write(path, text).map_err(|source| CliError::Write {
            path: path.to_path_buf(),
            source,
        }),
        None => {
            let mut out = io::stdout().lock();
            match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(CliError::Stdout(e)),
                _ => Ok(()),
            }
        }
    }
}
