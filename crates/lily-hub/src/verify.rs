//! Checking file contents against the Hub's metadata. An LFS file (weights, anything large) is
//! known by the sha256 of its content; a regular git file by its git blob id, the sha1 of
//! `blob {size}\0` followed by the content. Both are in the Hub's file list, so every file can
//! be checked, not only its size.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use sha1::Sha1;
use sha2::{Digest, Sha256};

/// The hash a file's content must have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Checksum {
    /// Lowercase hex sha256 of the content (LFS files).
    Sha256(String),
    /// Lowercase hex git blob sha1 (regular files).
    GitBlobSha1(String),
}

impl Checksum {
    pub fn algorithm(&self) -> &'static str {
        match self {
            Checksum::Sha256(_) => "sha256",
            Checksum::GitBlobSha1(_) => "git blob sha1",
        }
    }

    pub fn expected(&self) -> &str {
        match self {
            Checksum::Sha256(h) | Checksum::GitBlobSha1(h) => h,
        }
    }
}

/// An incremental hash of a file's content, in the form `Checksum` names.
pub struct ContentHasher {
    state: State,
    hashed: u64,
}

enum State {
    Sha256(Sha256),
    GitBlobSha1(Sha1),
}

impl ContentHasher {
    /// A hasher for content of `size` bytes (the git blob header includes the size).
    pub fn new(checksum: &Checksum, size: u64) -> Self {
        let state = match checksum {
            Checksum::Sha256(_) => State::Sha256(Sha256::new()),
            Checksum::GitBlobSha1(_) => {
                let mut sha1 = Sha1::new();
                sha1.update(format!("blob {size}\0").as_bytes());
                State::GitBlobSha1(sha1)
            }
        };
        ContentHasher { state, hashed: 0 }
    }

    pub fn update(&mut self, bytes: &[u8]) {
        match &mut self.state {
            State::Sha256(h) => h.update(bytes),
            State::GitBlobSha1(h) => h.update(bytes),
        }
        self.hashed += bytes.len() as u64;
    }

    /// How many content bytes have been hashed.
    pub fn hashed_len(&self) -> u64 {
        self.hashed
    }

    /// The lowercase hex digest.
    pub fn finish(self) -> String {
        match self.state {
            State::Sha256(h) => hex(&h.finalize()),
            State::GitBlobSha1(h) => hex(&h.finalize()),
        }
    }
}

/// Feeds the whole file at `path` to `hasher`, calling `progress` with each chunk's length.
pub fn hash_file(
    path: &Path,
    hasher: &mut ContentHasher,
    progress: &mut dyn FnMut(u64),
) -> std::io::Result<()> {
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buf[..n]);
        progress(n as u64);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(checksum: &Checksum, content: &[u8]) -> String {
        let mut h = ContentHasher::new(checksum, content.len() as u64);
        // Two pieces: the incremental path must equal the one-shot digest.
        let (a, b) = content.split_at(content.len() / 2);
        h.update(a);
        h.update(b);
        assert_eq!(h.hashed_len(), content.len() as u64);
        h.finish()
    }

    #[test]
    fn digests_match_published_values() {
        // FIPS 180-2's "abc" vector.
        assert_eq!(
            digest(&Checksum::Sha256(String::new()), b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // `printf 'hello\n' | git hash-object --stdin`.
        assert_eq!(
            digest(&Checksum::GitBlobSha1(String::new()), b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
    }

    #[test]
    fn hashing_a_file_reports_every_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let content: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &content).unwrap();
        let checksum = Checksum::Sha256(String::new());
        let mut h = ContentHasher::new(&checksum, content.len() as u64);
        let mut seen = 0;
        hash_file(&path, &mut h, &mut |n| seen += n).unwrap();
        assert_eq!(seen, content.len() as u64);
        assert_eq!(h.finish(), digest(&checksum, &content));
    }
}
