//! The registry's rules on a local directory and on an in-memory object store (which, like S3 and
//! GCS, refuses stale conditional writes): versions claimed without a lock, the config switched to
//! the newest approved version, incomplete uploads never served.

use std::path::Path;
use std::sync::Arc;

use recsys_engine::engine_dir::Precision;
use recsys_engine::{fixtures, ModelKind};
use recsys_registry::config::{policy_versions, CONFIG_FILE};
use recsys_registry::publish::{publish, PublishRequest};
use recsys_registry::status::set_status;
use recsys_registry::versions::{self, record_key};
use recsys_registry::{Repository, Status};

fn engine(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("engine");
    fixtures::convert(ModelKind::Vaecf, "model.safetensors", &out, Precision::Fp32).unwrap();
    out
}

fn request<'a>(engine: &'a Path, approve: bool) -> PublishRequest<'a> {
    PublishRequest {
        model: "vaecf",
        engine_dir: engine,
        approve,
        metrics: None,
        max_batch_size: 32,
    }
}

fn served(repo: &Repository) -> Vec<u64> {
    let config = repo.read(&format!("vaecf/{CONFIG_FILE}")).unwrap().unwrap();
    policy_versions(std::str::from_utf8(&config.bytes).unwrap()).unwrap()
}

fn repositories(tmp: &Path) -> Vec<Repository> {
    vec![
        Repository::open(tmp.join("repo").to_str().unwrap()).unwrap(),
        Repository::in_memory(),
    ]
}

#[test]
fn publish_approve_reject_move_the_config_to_the_newest_approved_version() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        let err = publish(&repo, &request(&engine, false), &mut |_, _| {})
            .err()
            .unwrap();
        assert!(err.to_string().contains("--approve"), "{err}");
        let first = publish(&repo, &request(&engine, true), &mut |_, _| {}).unwrap();
        assert_eq!(first.info.version, 1);
        assert!(first.created_config);
        assert_eq!(served(&repo), [1]);
        let mut last = 0;
        let second = publish(&repo, &request(&engine, false), &mut |sent, total| {
            assert!(sent >= last && sent <= total);
            last = sent;
        })
        .unwrap();
        assert!(last > 0);
        assert_eq!(
            (second.info.version, second.info.status),
            (2, Status::Pending)
        );
        assert!(!second.created_config);
        assert_eq!(served(&repo), [1], "a pending version must not serve");
        assert!(!second.info.files.is_empty());
        assert_eq!(set_status(&repo, "vaecf", 2, Status::Approved).unwrap(), 2);
        assert_eq!(served(&repo), [2]);
        assert_eq!(set_status(&repo, "vaecf", 2, Status::Rejected).unwrap(), 1);
        assert_eq!(served(&repo), [1]);
        let err = set_status(&repo, "vaecf", 1, Status::Rejected).unwrap_err();
        assert!(err.to_string().contains("only approved version"), "{err}");
        let err = set_status(&repo, "vaecf", 9, Status::Approved).unwrap_err();
        assert!(
            err.to_string().contains("no version 9 (versions: 1, 2)"),
            "{err}"
        );
        let listed = versions::list(&repo, "vaecf").unwrap();
        assert_eq!(listed[1].status, Status::Rejected);
        assert_eq!(listed[1].history.len(), 4, "{:?}", listed[1].history);
        // The uploaded files are the engine's, byte for byte.
        for (name, size) in &listed[0].files {
            let object = repo.read(&format!("vaecf/1/{name}")).unwrap().unwrap();
            assert_eq!(object.bytes.len() as u64, *size);
            assert_eq!(object.bytes, std::fs::read(engine.join(name)).unwrap());
        }
    }
}

#[test]
fn an_incomplete_version_never_serves_and_is_not_reused() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        publish(&repo, &request(&engine, true), &mut |_, _| {}).unwrap();
        // What a publish killed mid-upload leaves: a claimed record and part of the files.
        let mut claim = versions::list(&repo, "vaecf").unwrap()[0].clone();
        claim.version = 2;
        claim.status = Status::Incomplete;
        assert!(repo
            .create(&record_key("vaecf", 2), &claim.to_json())
            .unwrap());
        repo.overwrite("vaecf/2/manifest.json", b"{").unwrap();
        let err = set_status(&repo, "vaecf", 2, Status::Approved).unwrap_err();
        assert!(err.to_string().contains("incomplete"), "{err}");
        assert_eq!(served(&repo), [1]);
        let next = publish(&repo, &request(&engine, true), &mut |_, _| {}).unwrap();
        assert_eq!(next.info.version, 3);
        assert_eq!(served(&repo), [3]);
        // Rejecting the newest falls back past the incomplete one.
        assert_eq!(set_status(&repo, "vaecf", 3, Status::Rejected).unwrap(), 1);
        // A folder with neither record nor engine (a copy cut short) is not an approved version.
        repo.overwrite("vaecf/7/weights.safetensors", b"partial")
            .unwrap();
        assert_eq!(
            versions::list(&repo, "vaecf")
                .unwrap()
                .last()
                .unwrap()
                .status,
            Status::Incomplete
        );
        assert_eq!(recsys_registry::config::switch(&repo, "vaecf").unwrap(), 1);
    }
}

#[test]
fn concurrent_publishers_get_distinct_versions() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    let repo_dir = tmp.path().join("shared");
    let first = Repository::open(repo_dir.to_str().unwrap()).unwrap();
    publish(&first, &request(&engine, true), &mut |_, _| {}).unwrap();
    let engine = Arc::new(engine);
    let publishers: Vec<_> = (0..4)
        .map(|_| {
            let engine = engine.clone();
            let repo_dir = repo_dir.clone();
            std::thread::spawn(move || {
                // Each publisher its own client, as separate processes would be.
                let repo = Repository::open(repo_dir.to_str().unwrap()).unwrap();
                publish(&repo, &request(&engine, false), &mut |_, _| {})
                    .unwrap()
                    .info
                    .version
            })
        })
        .collect();
    let mut got: Vec<u64> = publishers.into_iter().map(|p| p.join().unwrap()).collect();
    got.sort_unstable();
    assert_eq!(got, [2, 3, 4, 5]);
    let listed = versions::list(&first, "vaecf").unwrap();
    assert_eq!(listed.len(), 5);
    assert!(listed[1..].iter().all(|v| v.status == Status::Pending));
}
