//! A corpus read from a text file or a folder of them (`--data PATH`).

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{ByteTokenizer, Corpus, DataError};

/// The byte-tokenized contents of a file, or of every file under a folder.
///
/// A folder is read **recursively**, entries sorted by file name (byte order) at every level,
/// so the stream is the same on every machine and file system whatever order the directory
/// listing comes in. Hidden entries (names starting with `.`, e.g. `.git`, `.DS_Store`) are
/// skipped; symbolic links to files are followed, links to folders are not (a link cycle
/// would never end). Files are taken byte for byte — no UTF-8 check, since the tokenizer is
/// byte-level — and a newline is inserted after a file that does not end in one, so the last
/// word of one file never fuses with the first of the next.
#[derive(Debug, Clone)]
pub struct TextCorpus {
    path: PathBuf,
    files: Vec<(PathBuf, usize)>,
    tokens: Arc<[u32]>,
}

impl TextCorpus {
    /// Reads `path`: a file, or a folder whose files are concatenated as described above.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self, DataError> {
        let path = path.as_ref().to_path_buf();
        let meta = fs::metadata(&path).map_err(|source| match source.kind() {
            ErrorKind::NotFound => DataError::NotFound { path: path.clone() },
            _ => DataError::Io {
                path: path.clone(),
                source,
            },
        })?;
        let mut files = Vec::new();
        if meta.is_dir() {
            collect_files(&path, &mut files)?;
        } else {
            files.push(path.clone());
        }

        let mut bytes = Vec::new();
        let mut sizes = Vec::with_capacity(files.len());
        for file in files {
            let data = fs::read(&file).map_err(|source| DataError::Io {
                path: file.clone(),
                source,
            })?;
            if !data.is_empty() && bytes.last().is_some_and(|&b| b != b'\n') {
                bytes.push(b'\n');
            }
            bytes.extend_from_slice(&data);
            sizes.push((file, data.len()));
        }
        if bytes.is_empty() {
            return Err(DataError::Empty { path });
        }
        Ok(Self {
            path,
            files: sizes,
            tokens: ByteTokenizer.encode_bytes(&bytes).into(),
        })
    }

    /// The path the corpus was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The files read, in stream order, with their sizes in bytes.
    pub fn files(&self) -> &[(PathBuf, usize)] {
        &self.files
    }
}

impl Corpus for TextCorpus {
    fn tokens(&self) -> Arc<[u32]> {
        Arc::clone(&self.tokens)
    }

    fn describe(&self) -> String {
        format!(
            "{} ({} file{}, {} tokens)",
            self.path.display(),
            self.files.len(),
            if self.files.len() == 1 { "" } else { "s" },
            self.tokens.len()
        )
    }
}

/// Appends the regular files under `dir` to `out`, depth first, in name order.
fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), DataError> {
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Io { path, source }
    };
    let mut entries = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if entry.file_name().as_encoded_bytes().starts_with(b".") {
            continue;
        }
        entries.push(entry);
    }
    // Sorting by name at each level equals sorting full paths component by component.
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let kind = entry.file_type().map_err(io_err(&path))?;
        if kind.is_dir() {
            collect_files(&path, out)?;
        } else if kind.is_file() {
            out.push(path);
        } else if kind.is_symlink() {
            // Follow links to files only; a dangling link or one to a folder is skipped.
            if fs::metadata(&path).is_ok_and(|m| m.is_file()) {
                out.push(path);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh, empty scratch folder for one test, removed when the guard drops (also when
    /// the test fails).
    fn scratch(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("bfpp-data-{name}-"))
            .tempdir()
            .expect("create scratch folder")
    }

    fn text(corpus: &TextCorpus) -> String {
        ByteTokenizer.decode(&corpus.tokens())
    }

    #[test]
    fn reads_a_single_file_verbatim() {
        let scratch_dir = scratch("single");
        let dir = scratch_dir.path();
        let file = dir.join("a.txt");
        fs::write(&file, "no trailing newline").expect("write");
        let corpus = TextCorpus::from_path(&file).expect("read");
        assert_eq!(text(&corpus), "no trailing newline");
        assert_eq!(corpus.files().len(), 1);
    }

    #[test]
    fn folder_is_read_recursively_in_name_order_skipping_hidden() {
        let scratch_dir = scratch("folder");
        let dir = scratch_dir.path();
        fs::create_dir_all(dir.join("b_sub/inner")).expect("mkdir");
        fs::create_dir_all(dir.join(".git")).expect("mkdir");
        // Written out of order on purpose: the listing order must not matter.
        fs::write(dir.join("c.txt"), "C\n").expect("write");
        fs::write(dir.join("b_sub/inner/z.txt"), "BIZ").expect("write");
        fs::write(dir.join("a.txt"), "A").expect("write");
        fs::write(dir.join("b_sub/y.txt"), "BY\n").expect("write");
        fs::write(dir.join("empty.txt"), "").expect("write");
        fs::write(dir.join(".hidden"), "H").expect("write");
        fs::write(dir.join(".git/config"), "G").expect("write");
        let corpus = TextCorpus::from_path(dir).expect("read");
        // b_sub/inner/ sorts before b_sub/y.txt ("inner" < "y.txt").
        assert_eq!(text(&corpus), "A\nBIZ\nBY\nC\n");
        let names: Vec<_> = corpus
            .files()
            .iter()
            .map(|(p, _)| p.strip_prefix(dir).expect("under dir").to_path_buf())
            .collect();
        let expected = [
            "a.txt",
            "b_sub/inner/z.txt",
            "b_sub/y.txt",
            "c.txt",
            "empty.txt",
        ];
        assert_eq!(names, expected.map(PathBuf::from));
    }

    #[test]
    fn non_utf8_bytes_are_kept() {
        let scratch_dir = scratch("binary");
        let dir = scratch_dir.path();
        fs::write(dir.join("bin"), [0xFFu8, 0x00, 0xC3]).expect("write");
        let corpus = TextCorpus::from_path(dir).expect("read");
        assert_eq!(&*corpus.tokens(), &[255, 0, 195]);
    }

    #[test]
    fn missing_and_empty_paths_are_clear_errors() {
        let scratch_dir = scratch("errors");
        let dir = scratch_dir.path();
        let missing = dir.join("nope");
        let err = TextCorpus::from_path(&missing).expect_err("missing");
        assert!(matches!(err, DataError::NotFound { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("nope") && msg.contains("--data"), "{msg}");

        let err = TextCorpus::from_path(dir).expect_err("empty folder");
        assert!(matches!(err, DataError::Empty { .. }), "{err}");
        fs::write(dir.join("empty.txt"), "").expect("write");
        fs::write(dir.join(".hidden"), "x").expect("write");
        let err = TextCorpus::from_path(dir).expect_err("only empty files");
        assert!(err.to_string().contains("errors"), "{err}");
    }
}
