//! A local stand-in for the Hugging Face Hub, on 127.0.0.1 only, answering as the real one does
//! (huggingface_hub's client and its issue tracker describe the protocol):
//!
//! - `GET /api/models/{org}/{name}/revision/{rev}[?blobs=true]`: the commit `sha`, `gated`, and
//!   `siblings` with `size`, `blobId` and `lfs.sha256` when `blobs=true`. Public even for gated
//!   repositories, as on the Hub.
//! - `GET /{org}/{name}/resolve/{rev}/{path}`: an LFS file answers 302 to a CDN on a second port
//!   (another origin), with `X-Linked-Etag` (sha256) and `X-Linked-Size`; a regular file answers
//!   307 to `/api/resolve-cache/models/{org}/{name}/{commit}/{path}` with `ETag` (git blob id),
//!   except in gated repositories and for empty files, which are served directly. Every answer
//!   carries `X-Repo-Commit`.
//! - Errors with `X-Error-Code`: 401 `RepoNotFound`; 401 `GatedRepo` without a token, 403 with a
//!   token that has no access; 404 `RevisionNotFound` and `EntryNotFound`.
//! - Content answers honour `Range: bytes=N-` with 206 and `Content-Range`.
//!
//! Faults can be queued per file (cut the body short, corrupt a byte, ignore the range), and
//! every request is logged so tests can check what went over the wire.

#![allow(dead_code)] // Each test binary that includes this uses a different part of it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use sha1::Sha1;
use sha2::{Digest, Sha256};

/// Bound on how long a connection may sit idle, so no server thread outlives a test for long.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct FakeFile {
    pub path: String,
    pub content: Vec<u8>,
    /// Stored in LFS (served from the CDN, known by sha256).
    pub lfs: bool,
}

impl FakeFile {
    pub fn regular(path: &str, content: &[u8]) -> Self {
        FakeFile {
            path: path.to_string(),
            content: content.to_vec(),
            lfs: false,
        }
    }

    pub fn lfs(path: &str, content: &[u8]) -> Self {
        FakeFile {
            lfs: true,
            ..Self::regular(path, content)
        }
    }

    pub fn sha256(&self) -> String {
        hex(&Sha256::digest(&self.content))
    }

    /// The git blob id: sha1 of `blob {len}\0{content}`.
    pub fn git_blob_id(&self) -> String {
        let mut h = Sha1::new();
        h.update(format!("blob {}\0", self.content.len()).as_bytes());
        h.update(&self.content);
        hex(&h.finalize())
    }

    /// The name huggingface_hub gives the file's blob in the cache.
    pub fn etag(&self) -> String {
        if self.lfs {
            self.sha256()
        } else {
            self.git_blob_id()
        }
    }
}

#[derive(Clone)]
pub struct FakeRepo {
    pub id: String,
    /// `(commit sha, files)`, oldest first.
    pub commits: Vec<(String, Vec<FakeFile>)>,
    /// `(branch or tag, commit sha)`.
    pub refs: Vec<(String, String)>,
    /// Tokens allowed to download, when the repository is gated.
    pub gated_tokens: Option<Vec<String>>,
}

impl FakeRepo {
    /// A public repository with one commit on `main`.
    pub fn new(id: &str, commit: &str, files: Vec<FakeFile>) -> Self {
        FakeRepo {
            id: id.to_string(),
            commits: vec![(commit.to_string(), files)],
            refs: vec![("main".to_string(), commit.to_string())],
            gated_tokens: None,
        }
    }

    fn commit_of(&self, revision: &str) -> Option<&(String, Vec<FakeFile>)> {
        let sha = self
            .refs
            .iter()
            .find(|(name, _)| name == revision)
            .map_or(revision, |(_, sha)| sha.as_str());
        self.commits.iter().find(|(s, _)| s == sha)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Send the headers of the full answer but only this many body bytes, then close.
    CutAfter(usize),
    /// Flip one byte in the middle of the body.
    Corrupt,
    /// Answer 200 with the whole file even when a range was asked.
    IgnoreRange,
}

#[derive(Clone, Debug)]
pub struct LoggedRequest {
    /// `"hub"` or `"cdn"`.
    pub server: &'static str,
    pub method: String,
    pub target: String,
    pub range: Option<String>,
    pub authorization: Option<String>,
}

struct State {
    repos: Vec<FakeRepo>,
    faults: HashMap<String, Vec<Fault>>,
    log: Vec<LoggedRequest>,
}

pub struct FakeHub {
    pub endpoint: String,
    cdn: String,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    addrs: Vec<std::net::SocketAddr>,
}

impl FakeHub {
    pub fn start(repos: Vec<FakeRepo>) -> Self {
        let hub = TcpListener::bind("127.0.0.1:0").expect("bind the fake hub");
        let cdn = TcpListener::bind("127.0.0.1:0").expect("bind the fake CDN");
        let addrs = vec![hub.local_addr().unwrap(), cdn.local_addr().unwrap()];
        let state = Arc::new(Mutex::new(State {
            repos,
            faults: HashMap::new(),
            log: Vec::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let fake = FakeHub {
            endpoint: format!("http://{}", addrs[0]),
            cdn: format!("http://{}", addrs[1]),
            state,
            stop,
            addrs,
        };
        fake.serve(hub, "hub");
        fake.serve(cdn, "cdn");
        fake
    }

    /// Applies `fault` to the next answer that carries the content of the file `path`.
    pub fn fault(&self, path: &str, fault: Fault) {
        let mut state = self.state.lock().unwrap();
        state
            .faults
            .entry(path.to_string())
            .or_default()
            .push(fault);
    }

    pub fn requests(&self) -> Vec<LoggedRequest> {
        self.state.lock().unwrap().log.clone()
    }

    pub fn clear_log(&self) {
        self.state.lock().unwrap().log.clear();
    }

    /// Requests that fetched file content (CDN or Hub), with their Range header.
    pub fn content_requests(&self) -> Vec<LoggedRequest> {
        self.requests()
            .into_iter()
            .filter(|r| r.server == "cdn" || r.target.starts_with("/api/resolve-cache/"))
            .collect()
    }

    fn serve(&self, listener: TcpListener, server: &'static str) {
        let state = Arc::clone(&self.state);
        let stop = Arc::clone(&self.stop);
        let (endpoint, cdn) = (self.endpoint.clone(), self.cdn.clone());
        thread::spawn(move || {
            for stream in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let state = Arc::clone(&state);
                let (endpoint, cdn) = (endpoint.clone(), cdn.clone());
                thread::spawn(move || {
                    let ctx = Ctx {
                        state,
                        server,
                        endpoint,
                        cdn,
                    };
                    // A broken connection only ends that connection.
                    let _ = ctx.handle(stream);
                });
            }
        });
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loops so they see the flag.
        for addr in &self.addrs {
            let _ = TcpStream::connect_timeout(addr, Duration::from_secs(1));
        }
    }
}

struct Request {
    method: String,
    target: String,
    headers: HashMap<String, String>,
}

struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// The repository path of the file whose content is the body (for faults).
    content_of: Option<String>,
}

impl Answer {
    fn new(status: u16) -> Self {
        Answer {
            status,
            headers: Vec::new(),
            body: Vec::new(),
            content_of: None,
        }
    }

    fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }

    fn error(status: u16, code: &str, message: &str) -> Self {
        let body = serde_json::json!({ "error": message })
            .to_string()
            .into_bytes();
        Answer {
            body,
            ..Answer::new(status)
                .header("X-Error-Code", code)
                .header("X-Error-Message", message)
                .header("Content-Type", "application/json")
        }
    }
}

struct Ctx {
    state: Arc<Mutex<State>>,
    server: &'static str,
    endpoint: String,
    cdn: String,
}

impl Ctx {
    fn handle(&self, stream: TcpStream) -> std::io::Result<()> {
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let Some(request) = read_request(&mut reader)? else {
            return Ok(());
        };
        self.state.lock().unwrap().log.push(LoggedRequest {
            server: self.server,
            method: request.method.clone(),
            target: request.target.clone(),
            range: request.headers.get("range").cloned(),
            authorization: request.headers.get("authorization").cloned(),
        });
        let answer = self.route(&request);
        self.send(stream, &request, answer)
    }

    fn route(&self, req: &Request) -> Answer {
        let (path, query) = req.target.split_once('?').unwrap_or((&req.target, ""));
        let parts: Vec<String> = path.split('/').skip(1).map(percent_decode).collect();
        let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
        let state = self.state.lock().unwrap();
        match (self.server, parts.as_slice()) {
            ("cdn", ["lfs", sha]) => {
                let file = state
                    .repos
                    .iter()
                    .flat_map(|r| r.commits.iter().flat_map(|(_, files)| files))
                    .find(|f| f.lfs && f.sha256() == *sha);
                match file {
                    Some(f) => content_answer(f, req).header("ETag", format!("\"{sha}\"")),
                    None => Answer::new(404),
                }
            }
            ("hub", ["api", "models", org, name, "revision", rev]) => {
                let Some(repo) = find_repo(&state, org, name) else {
                    return Answer::error(401, "RepoNotFound", "Repository not found");
                };
                let Some((sha, files)) = repo.commit_of(rev) else {
                    return Answer::error(
                        404,
                        "RevisionNotFound",
                        &format!("Invalid rev id: {rev}"),
                    );
                };
                let blobs = query.split('&').any(|kv| kv == "blobs=true");
                let siblings: Vec<serde_json::Value> =
                    files.iter().map(|f| sibling(f, blobs)).collect();
                let gated = if repo.gated_tokens.is_some() {
                    serde_json::json!("manual")
                } else {
                    serde_json::json!(false)
                };
                let body = serde_json::json!({
                    "_id": "0123456789abcdef01234567", "id": repo.id, "modelId": repo.id,
                    "sha": sha, "private": false, "gated": gated, "disabled": false,
                    "lastModified": "2026-01-01T00:00:00.000Z", "siblings": siblings,
                });
                let mut answer = Answer::new(200).header("Content-Type", "application/json");
                answer.body = body.to_string().into_bytes();
                answer
            }
            ("hub", [org, name, "resolve", rev, rest @ ..]) => {
                self.resolve(&state, req, org, name, rev, &rest.join("/"), false)
            }
            ("hub", ["api", "resolve-cache", "models", org, name, rev, rest @ ..]) => {
                self.resolve(&state, req, org, name, rev, &rest.join("/"), true)
            }
            _ => Answer::new(404),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn resolve(
        &self,
        state: &State,
        req: &Request,
        org: &str,
        name: &str,
        rev: &str,
        path: &str,
        from_cache_route: bool,
    ) -> Answer {
        let Some(repo) = find_repo(state, org, name) else {
            return Answer::error(401, "RepoNotFound", "Repository not found");
        };
        if let Some(tokens) = &repo.gated_tokens {
            let token = req
                .headers
                .get("authorization")
                .and_then(|a| a.strip_prefix("Bearer "));
            match token {
                None => {
                    return Answer::error(
                        401,
                        "GatedRepo",
                        &format!(
                            "Access to model {} is restricted. You must have access to it and be \
                             authenticated to access it. Please log in.",
                            repo.id
                        ),
                    );
                }
                Some(t) if !tokens.iter().any(|allowed| allowed == t) => {
                    return Answer::error(
                        403,
                        "GatedRepo",
                        &format!(
                            "Access to model {} is restricted and you are not in the authorized \
                             list. Visit {}/{} to ask for access.",
                            repo.id, self.endpoint, repo.id
                        ),
                    );
                }
                Some(_) => {}
            }
        }
        let Some((sha, files)) = repo.commit_of(rev) else {
            return Answer::error(404, "RevisionNotFound", &format!("Invalid rev id: {rev}"));
        };
        let Some(file) = files.iter().find(|f| f.path == path) else {
            return Answer::error(404, "EntryNotFound", &format!("{path} does not exist"));
        };
        let answer = if file.lfs {
            Answer::new(302)
                .header(
                    "Location",
                    format!("{}/lfs/{}?X-Amz-Signature=fake", self.cdn, file.sha256()),
                )
                .header("X-Linked-Etag", format!("\"{}\"", file.sha256()))
                .header("X-Linked-Size", file.content.len().to_string())
                .header("ETag", format!("\"{}\"", file.git_blob_id()))
        } else if from_cache_route || repo.gated_tokens.is_some() || file.content.is_empty() {
            content_answer(file, req).header("ETag", format!("\"{}\"", file.git_blob_id()))
        } else {
            Answer::new(307)
                .header(
                    "Location",
                    format!(
                        "/api/resolve-cache/models/{}/{sha}/{}?etag=%22{}%22",
                        repo.id,
                        file.path,
                        file.git_blob_id()
                    ),
                )
                .header("ETag", format!("\"{}\"", file.git_blob_id()))
        };
        answer.header("X-Repo-Commit", sha.clone())
    }

    fn send(
        &self,
        mut stream: TcpStream,
        req: &Request,
        mut answer: Answer,
    ) -> std::io::Result<()> {
        let fault = answer.content_of.as_ref().and_then(|path| {
            let mut state = self.state.lock().unwrap();
            let queue = state.faults.get_mut(path)?;
            (!queue.is_empty()).then(|| queue.remove(0))
        });
        if fault == Some(Fault::IgnoreRange) && answer.status == 206 {
            answer = self.route(&Request {
                method: req.method.clone(),
                target: req.target.clone(),
                headers: HashMap::new(),
            });
        }
        if fault == Some(Fault::Corrupt) && !answer.body.is_empty() {
            let mid = answer.body.len() / 2;
            answer.body[mid] ^= 0xff;
        }
        let mut head = format!("HTTP/1.1 {} {}\r\n", answer.status, reason(answer.status));
        for (name, value) in &answer.headers {
            head += &format!("{name}: {value}\r\n");
        }
        head += &format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            answer.body.len()
        );
        stream.write_all(head.as_bytes())?;
        let body = match fault {
            Some(Fault::CutAfter(n)) => &answer.body[..n.min(answer.body.len())],
            _ => &answer.body[..],
        };
        if req.method != "HEAD" {
            stream.write_all(body)?;
        }
        stream.flush()?;
        // Close our side, then wait for the client to close its own, so that nothing sent is
        // lost to a reset.
        stream.shutdown(Shutdown::Write)?;
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).is_ok_and(|n| n > 0) {}
        Ok(())
    }
}

fn find_repo<'a>(state: &'a State, org: &str, name: &str) -> Option<&'a FakeRepo> {
    let id = format!("{org}/{name}");
    state.repos.iter().find(|r| r.id == id)
}

fn sibling(f: &FakeFile, blobs: bool) -> serde_json::Value {
    if !blobs {
        return serde_json::json!({ "rfilename": f.path });
    }
    let mut s = serde_json::json!({
        "rfilename": f.path, "size": f.content.len(), "blobId": f.git_blob_id(),
    });
    if f.lfs {
        s["lfs"] = serde_json::json!({
            "sha256": f.sha256(), "size": f.content.len(), "pointerSize": 134,
        });
    }
    s
}

/// The file's bytes, or the part a `Range: bytes=N-` asks for.
fn content_answer(file: &FakeFile, req: &Request) -> Answer {
    let len = file.content.len();
    let start = req
        .headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok());
    let mut answer = match start {
        Some(s) if s >= len => {
            return Answer::new(416).header("Content-Range", format!("bytes */{len}"));
        }
        Some(s) => Answer::new(206).header("Content-Range", format!("bytes {s}-{}/{len}", len - 1)),
        None => Answer::new(200),
    };
    answer.body = file.content[start.unwrap_or(0)..].to_vec();
    answer.content_of = Some(file.path.clone());
    answer
}

fn read_request(reader: &mut BufReader<TcpStream>) -> std::io::Result<Option<Request>> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut words = line.split_whitespace();
    let (Some(method), Some(target)) = (words.next(), words.next()) else {
        return Ok(None);
    };
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Ok(Some(Request {
        method: method.to_string(),
        target: target.to_string(),
        headers,
    }))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hexpair = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (
            bytes[i],
            hexpair.and_then(|h| u8::from_str_radix(h, 16).ok()),
        ) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        307 => "Temporary Redirect",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        _ => "Status",
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Deterministic bytes that compress badly, so a cut or a flipped byte cannot go unnoticed.
pub fn pseudo_random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
