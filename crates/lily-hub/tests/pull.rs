//! `pull` against a local Hub (tests/support/fake_hub.rs) on 127.0.0.1: a fresh cache, resumed
//! transfers, corrupt data, pinned commits, gated repositories. Nothing leaves loopback.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use lily_hub::{
    FileOutcome, HubError, HubSettings, ModelSpec, PullProgress, PullReport, Quiet, RepoId,
    Revision, find_cached_model, place_in_dir, pull,
};
use support::fake_hub::{FakeFile, FakeHub, FakeRepo, Fault, pseudo_random_bytes};

const REPO: &str = "lily-test/tiny";
const COMMIT: &str = "1111111111111111111111111111111111111111";
const OLD_COMMIT: &str = "0000000000000000000000000000000000000aaa";
const BIG: &str = "model.safetensors";
const BIG_LEN: usize = 3 << 20;

fn files() -> Vec<FakeFile> {
    vec![
        FakeFile::regular("config.json", br#"{"model_type": "qwen3_5_moe"}"#),
        FakeFile::lfs(BIG, &pseudo_random_bytes(BIG_LEN, 1)),
        FakeFile::lfs("extra/small.bin", &pseudo_random_bytes(1000, 2)),
        FakeFile::regular("tokenizer/vocab.txt", b"hello\nworld\n"),
        FakeFile::regular("empty.txt", b""),
    ]
}

fn hub() -> FakeHub {
    FakeHub::start(vec![FakeRepo::new(REPO, COMMIT, files())])
}

/// Settings for `hub` with a cache in `cache`: no token, no waiting between attempts.
fn settings(hub: &FakeHub, cache: &Path, attempts: u32) -> HubSettings {
    let mut s = HubSettings::from_vars(|name| (name == "HOME").then(|| "/nonexistent".into()))
        .expect("settings");
    s.endpoint = hub.endpoint.clone();
    s.cache_dir = cache.to_path_buf();
    s.attempts = attempts;
    s.retry_delay = Duration::ZERO;
    s.connect_timeout = Duration::from_secs(10);
    s.read_timeout = Duration::from_secs(10);
    s
}

fn repo() -> RepoId {
    RepoId::parse(REPO).unwrap()
}

fn repo_dir(cache: &Path) -> PathBuf {
    cache.join("models--lily-test--tiny")
}

fn outcome<'a>(report: &'a PullReport, file: &str) -> &'a FileOutcome {
    &report
        .files
        .iter()
        .find(|(name, _, _)| name == file)
        .unwrap_or_else(|| panic!("{file} not in the report"))
        .2
}

/// Asserts that every file of `expected` is in the snapshot of `commit` as the Hub lays it
/// out: a relative symlink into `blobs/{etag}` with the right content.
fn assert_snapshot(cache: &Path, commit: &str, expected: &[FakeFile]) {
    let snapshot = repo_dir(cache).join("snapshots").join(commit);
    for f in expected {
        let link = snapshot.join(&f.path);
        let target = std::fs::read_link(&link)
            .unwrap_or_else(|e| panic!("{} is not a symlink: {e}", link.display()));
        let depth = f.path.split('/').count() + 1;
        let expected_target = format!("{}blobs/{}", "../".repeat(depth), f.etag());
        assert_eq!(target, PathBuf::from(expected_target), "{}", f.path);
        assert_eq!(std::fs::read(&link).unwrap(), f.content, "{}", f.path);
    }
}

fn incomplete_files(cache: &Path) -> Vec<String> {
    let blobs = repo_dir(cache).join("blobs");
    let Ok(entries) = std::fs::read_dir(blobs) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".incomplete"))
        .collect()
}

/// Records retries for the tests that expect them.
#[derive(Default)]
struct Recorder {
    retries: Vec<(String, String)>,
    downloaded: u64,
}

impl PullProgress for Recorder {
    fn advance(&mut self, bytes: u64) {
        self.downloaded += bytes;
    }

    fn retry(&mut self, file: &str, _attempt: u32, error: &HubError) {
        self.retries.push((file.to_string(), error.to_string()));
    }
}

#[test]
fn a_full_pull_fills_a_fresh_cache_in_the_hub_layout() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    let s = settings(&hub, cache.path(), 1);
    let report = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    assert_eq!(report.commit, COMMIT);
    assert_eq!(report.files.len(), 5);
    assert_eq!(
        report.total_bytes(),
        files().iter().map(|f| f.content.len() as u64).sum::<u64>()
    );
    assert_eq!(report.downloaded_bytes(), report.total_bytes());
    assert_snapshot(cache.path(), COMMIT, &files());
    let main_ref = std::fs::read_to_string(repo_dir(cache.path()).join("refs/main")).unwrap();
    assert_eq!(main_ref, COMMIT);
    assert!(incomplete_files(cache.path()).is_empty());
    // LFS content came from the CDN, regular files through the Hub's resolve-cache redirect.
    let content = hub.content_requests();
    assert_eq!(content.iter().filter(|r| r.server == "cdn").count(), 2);
    assert_eq!(content.len(), 4, "{content:?}"); // the empty file is served by resolve itself

    // A second pull verifies what is there and downloads nothing.
    hub.clear_log();
    let again = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    assert!(
        again
            .files
            .iter()
            .all(|(_, _, o)| *o == FileOutcome::Cached),
        "{again:?}"
    );
    let log = hub.requests();
    assert_eq!(log.len(), 1, "only the file list is asked for: {log:?}");
    assert!(
        log[0]
            .target
            .starts_with("/api/models/lily-test/tiny/revision/main")
    );

    // The pulled model is found offline, by repository id.
    let spec = ModelSpec::parse(REPO).unwrap();
    assert_eq!(find_cached_model(&s, &spec).unwrap(), report.snapshot);
}

#[test]
fn a_transfer_cut_half_way_resumes_from_where_it_stopped() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    let s = settings(&hub, cache.path(), 1);
    let half = BIG_LEN / 2;
    hub.fault(BIG, Fault::CutAfter(half));
    let err = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap_err();
    match &err {
        HubError::Interrupted {
            file,
            received,
            expected,
            ..
        } => {
            assert_eq!(
                (file.as_str(), *received, *expected),
                (BIG, half as u64, BIG_LEN as u64)
            );
        }
        other => panic!("expected an interrupted transfer, got {other:?}"),
    }
    assert!(err.to_string().contains("resume"), "{err}");
    // The partial data waits under .incomplete; no blob, no link, no ref claims the file.
    let big = FakeFile::lfs(BIG, &pseudo_random_bytes(BIG_LEN, 1));
    let blobs = repo_dir(cache.path()).join("blobs");
    let partial = blobs.join(format!("{}.incomplete", big.etag()));
    assert_eq!(std::fs::metadata(&partial).unwrap().len(), half as u64);
    assert!(!blobs.join(big.etag()).exists());
    assert!(
        !repo_dir(cache.path())
            .join("snapshots")
            .join(COMMIT)
            .join(BIG)
            .exists()
    );
    assert!(!repo_dir(cache.path()).join("refs/main").exists());

    // The next pull asks only for the missing half.
    hub.clear_log();
    let report = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    assert_eq!(
        *outcome(&report, BIG),
        FileOutcome::Downloaded {
            resumed_from: half as u64
        }
    );
    let cdn: Vec<_> = hub
        .content_requests()
        .into_iter()
        .filter(|r| r.target.contains(&big.sha256()))
        .collect();
    assert_eq!(cdn.len(), 1, "{cdn:?}");
    assert_eq!(
        cdn[0].range.as_deref(),
        Some(format!("bytes={half}-").as_str())
    );
    assert_snapshot(cache.path(), COMMIT, &files());
    assert!(incomplete_files(cache.path()).is_empty());
}

#[test]
fn a_cut_transfer_is_resumed_within_the_same_pull() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    let s = settings(&hub, cache.path(), 3);
    hub.fault(BIG, Fault::CutAfter(BIG_LEN / 3));
    let mut recorder = Recorder::default();
    let report = pull(&s, &repo(), &Revision::main(), &mut recorder).unwrap();
    assert_eq!(recorder.retries.len(), 1, "{:?}", recorder.retries);
    assert_eq!(recorder.retries[0].0, BIG);
    // Each byte of the big file crossed the wire once.
    let ranges: Vec<_> = hub
        .content_requests()
        .into_iter()
        .filter(|r| r.server == "cdn" && r.target.contains(&files()[1].sha256()))
        .map(|r| r.range)
        .collect();
    assert_eq!(ranges, vec![None, Some(format!("bytes={}-", BIG_LEN / 3))]);
    assert_eq!(
        *outcome(&report, BIG),
        FileOutcome::Downloaded { resumed_from: 0 }
    );
    assert_snapshot(cache.path(), COMMIT, &files());
}

#[test]
fn a_server_that_ignores_the_range_gets_the_file_rewritten_not_appended() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    let s = settings(&hub, cache.path(), 1);
    hub.fault(BIG, Fault::CutAfter(1000));
    assert!(pull(&s, &repo(), &Revision::main(), &mut Quiet).is_err());
    hub.fault(BIG, Fault::IgnoreRange);
    let report = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    assert_eq!(
        *outcome(&report, BIG),
        FileOutcome::Downloaded { resumed_from: 1000 }
    );
    assert_snapshot(cache.path(), COMMIT, &files());
}

#[test]
fn corrupt_bytes_in_transit_are_rejected_and_fetched_again() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    hub.fault(BIG, Fault::Corrupt);
    let mut recorder = Recorder::default();
    let s = settings(&hub, cache.path(), 2);
    pull(&s, &repo(), &Revision::main(), &mut recorder).unwrap();
    assert_eq!(recorder.retries.len(), 1);
    assert!(
        recorder.retries[0].1.contains("sha256"),
        "{:?}",
        recorder.retries
    );
    assert_snapshot(cache.path(), COMMIT, &files());

    // With no attempt left, the bad copy is deleted and nothing is linked.
    let cache = tempfile::tempdir().unwrap();
    hub.fault(BIG, Fault::Corrupt);
    let s = settings(&hub, cache.path(), 1);
    let err = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap_err();
    assert!(
        matches!(err, HubError::ChecksumMismatch { ref file, .. } if file == BIG),
        "{err}"
    );
    let big = &files()[1];
    assert!(
        !repo_dir(cache.path())
            .join("blobs")
            .join(big.etag())
            .exists()
    );
    assert!(incomplete_files(cache.path()).is_empty());
    assert!(
        !repo_dir(cache.path())
            .join("snapshots")
            .join(COMMIT)
            .join(BIG)
            .exists()
    );
}

#[test]
fn a_corrupt_or_truncated_cached_file_is_detected_and_refetched() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    let s = settings(&hub, cache.path(), 1);
    pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    let blobs = repo_dir(cache.path()).join("blobs");
    let all = files();
    // Same length, one byte changed: only the hash can tell.
    let big_blob = blobs.join(all[1].etag());
    let mut bytes = std::fs::read(&big_blob).unwrap();
    bytes[12345] ^= 1;
    std::fs::write(&big_blob, bytes).unwrap();
    // A regular file cut short.
    let config_blob = blobs.join(all[0].etag());
    std::fs::write(&config_blob, b"{").unwrap();

    let report = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    assert_eq!(*outcome(&report, BIG), FileOutcome::Refetched);
    assert_eq!(*outcome(&report, "config.json"), FileOutcome::Refetched);
    assert_eq!(
        *outcome(&report, "tokenizer/vocab.txt"),
        FileOutcome::Cached
    );
    assert_snapshot(cache.path(), COMMIT, &all);
}

#[test]
fn a_revision_pinned_by_commit_gets_that_commit() {
    let new_files = files();
    let mut old_files = files();
    old_files[0] = FakeFile::regular("config.json", br#"{"model_type": "old"}"#);
    let hub = FakeHub::start(vec![FakeRepo {
        id: REPO.to_string(),
        commits: vec![
            (OLD_COMMIT.to_string(), old_files.clone()),
            (COMMIT.to_string(), new_files.clone()),
        ],
        refs: vec![("main".to_string(), COMMIT.to_string())],
        gated_tokens: None,
    }]);
    let cache = tempfile::tempdir().unwrap();
    let s = settings(&hub, cache.path(), 1);
    let pinned = Revision::parse(OLD_COMMIT).unwrap();
    let report = pull(&s, &repo(), &pinned, &mut Quiet).unwrap();
    assert_eq!(report.commit, OLD_COMMIT);
    assert_snapshot(cache.path(), OLD_COMMIT, &old_files);
    // A commit needs no ref, and main was not touched.
    assert!(!repo_dir(cache.path()).join("refs").exists());
    let spec = ModelSpec::parse(&format!("{REPO}@{OLD_COMMIT}")).unwrap();
    assert_eq!(find_cached_model(&s, &spec).unwrap(), report.snapshot);
    assert!(matches!(
        find_cached_model(&s, &ModelSpec::parse(REPO).unwrap()),
        Err(HubError::NotCached { .. })
    ));

    // Pulling main adds the new commit; the unchanged weights are not downloaded again.
    hub.clear_log();
    let report = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    assert_eq!(report.commit, COMMIT);
    assert_eq!(*outcome(&report, BIG), FileOutcome::Cached);
    assert_eq!(
        *outcome(&report, "config.json"),
        FileOutcome::Downloaded { resumed_from: 0 }
    );
    assert!(hub.content_requests().iter().all(|r| r.server != "cdn"));
    assert_snapshot(cache.path(), COMMIT, &new_files);
    assert_snapshot(cache.path(), OLD_COMMIT, &old_files);
    let main_ref = std::fs::read_to_string(repo_dir(cache.path()).join("refs/main")).unwrap();
    assert_eq!(main_ref, COMMIT);
}

#[test]
fn a_gated_repo_needs_a_token_with_access() {
    let mut gated = FakeRepo::new(REPO, COMMIT, files());
    gated.gated_tokens = Some(vec!["hf_granted".to_string()]);
    let hub = FakeHub::start(vec![gated]);
    let cache = tempfile::tempdir().unwrap();

    // No token: a clear error before any download, and nothing written.
    let mut s = settings(&hub, cache.path(), 1);
    let err = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap_err();
    assert!(matches!(err, HubError::GatedWithoutToken { .. }), "{err:?}");
    let message = err.to_string();
    for needle in ["gated", "HF_TOKEN", "accept its terms", REPO] {
        assert!(
            message.contains(needle),
            "{needle:?} missing from: {message}"
        );
    }
    assert_eq!(hub.requests().len(), 1);
    assert!(!repo_dir(cache.path()).exists());

    // A token without access: the Hub's 403 becomes an error that says so.
    s.token = Some("hf_not_granted".to_string());
    let err = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap_err();
    assert!(
        matches!(err, HubError::GatedWithoutAccess { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("no access"), "{err}");
    assert!(
        !err.to_string().contains("hf_not_granted"),
        "the token leaked: {err}"
    );

    // The right token works, and goes to the Hub only, never to the CDN.
    hub.clear_log();
    s.token = Some("hf_granted".to_string());
    pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    assert_snapshot(cache.path(), COMMIT, &files());
    for r in hub.requests() {
        let expected = (r.server == "hub").then_some("Bearer hf_granted");
        assert_eq!(r.authorization.as_deref(), expected, "{r:?}");
    }
}

#[test]
fn unknown_repositories_and_revisions_are_named_in_the_error() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    let s = settings(&hub, cache.path(), 1);
    let missing = RepoId::parse("lily-test/missing").unwrap();
    let err = pull(&s, &missing, &Revision::main(), &mut Quiet).unwrap_err();
    assert!(matches!(err, HubError::RepoNotFound { .. }), "{err:?}");
    assert!(err.to_string().contains("lily-test/missing"), "{err}");
    let rev = Revision::parse("v9").unwrap();
    let err = pull(&s, &repo(), &rev, &mut Quiet).unwrap_err();
    assert!(matches!(err, HubError::RevisionNotFound { .. }), "{err:?}");
    assert!(err.to_string().contains("v9"), "{err}");
}

#[test]
fn offline_mode_refuses_to_download() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    let mut s = settings(&hub, cache.path(), 1);
    s.offline = true;
    let err = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap_err();
    assert!(matches!(err, HubError::Offline { .. }), "{err:?}");
    assert!(hub.requests().is_empty());
}

#[test]
fn a_cache_laid_out_by_huggingface_hub_is_reused() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    // What huggingface_hub's snapshot_download leaves: blobs by ETag, relative links, a ref.
    let repo_dir = repo_dir(cache.path());
    let snapshot = repo_dir.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(repo_dir.join("blobs")).unwrap();
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    std::fs::write(repo_dir.join("refs/main"), COMMIT).unwrap();
    for f in files() {
        std::fs::write(repo_dir.join("blobs").join(f.etag()), &f.content).unwrap();
        let link = snapshot.join(&f.path);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        let depth = f.path.split('/').count() + 1;
        let target = format!("{}blobs/{}", "../".repeat(depth), f.etag());
        std::os::unix::fs::symlink(target, link).unwrap();
    }
    let s = settings(&hub, cache.path(), 1);
    let report = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    assert!(
        report
            .files
            .iter()
            .all(|(_, _, o)| *o == FileOutcome::Cached),
        "{report:?}"
    );
    assert!(hub.content_requests().is_empty());
}

#[test]
fn pulled_files_can_be_placed_in_a_plain_directory() {
    let hub = hub();
    let cache = tempfile::tempdir().unwrap();
    let s = settings(&hub, cache.path(), 1);
    let report = pull(&s, &repo(), &Revision::main(), &mut Quiet).unwrap();
    let out = tempfile::tempdir().unwrap();
    std::fs::write(out.path().join("config.json"), "stale").unwrap();
    place_in_dir(&report, out.path()).unwrap();
    for f in files() {
        let path = out.path().join(&f.path);
        assert!(
            !std::fs::symlink_metadata(&path).unwrap().is_symlink(),
            "{}",
            f.path
        );
        assert_eq!(std::fs::read(&path).unwrap(), f.content, "{}", f.path);
    }
}
