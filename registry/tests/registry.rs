//! The registry's rules on a local directory and on an in-memory object store (which, like S3 and
//! GCS, refuses stale conditional writes): versions claimed without a lock, the config switched to
//! the newest approved version, incomplete uploads never served.

use std::path::Path;
use std::sync::Arc;

use recsys_engine::engine_dir::Precision;
use recsys_engine::{fixtures, ModelKind};
use recsys_registry::config::{policy_versions, CONFIG_FILE};
use recsys_registry::publish::{publish, PublishRequest};
use recsys_registry::release::{self, Fleet, Release};
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
        eval_set: None,
    }
}

/// `publish --approve` with no replicas: the integrity gate, then the switch.
fn publish_approved(repo: &Repository, engine: &Path) -> (versions::VersionInfo, Release) {
    release::publish_and_approve(
        repo,
        &request(engine, true),
        32,
        &Fleet::none(),
        &mut |_, _| {},
        &mut |_| {},
    )
    .unwrap()
}

fn served(repo: &Repository) -> Vec<u64> {
    let config = repo.read(&format!("vaecf/{CONFIG_FILE}")).unwrap().unwrap();
    policy_versions(std::str::from_utf8(&config.bytes).unwrap()).unwrap()
}

/// Every version's status, oldest first.
fn statuses(repo: &Repository) -> Vec<Status> {
    versions::list(repo, "vaecf")
        .unwrap()
        .iter()
        .map(|v| v.status)
        .collect()
}

/// Whether no command holds vaecf's lease.
fn lease_free(repo: &Repository) -> bool {
    recsys_registry::lease::current(repo, "vaecf")
        .unwrap()
        .is_none()
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
        let (first, release) = publish_approved(&repo, &engine);
        assert_eq!(first.version, 1);
        assert_eq!(first.status, Status::Approved);
        assert!(release.created_config);
        assert!(release.verified.is_some());
        assert_eq!(served(&repo), [1]);
        let mut last = 0;
        let second = publish(&repo, &request(&engine, false), &mut |sent, total| {
            assert!(sent >= last && sent <= total);
            last = sent;
        })
        .unwrap();
        assert!(last > 0);
        assert_eq!((second.version, second.status), (2, Status::Pending));
        assert_eq!(served(&repo), [1], "a pending version must not serve");
        assert!(!second.files.is_empty());
        assert_eq!(second.checksums.len(), second.files.len());
        assert!(second.self_check.is_some());
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
        assert!(listed[0].history[0].starts_with("upload started"));
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
        publish_approved(&repo, &engine);
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
        let (next, _) = publish_approved(&repo, &engine);
        assert_eq!(next.version, 3);
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
    publish_approved(&first, &engine);
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

#[test]
fn a_corrupted_version_is_refused_before_anything_changes_and_the_reason_is_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        publish_approved(&repo, &engine);
        let pending = publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        let key = format!("vaecf/{}/weights.safetensors", pending.version);
        let mut bytes = repo.read(&key).unwrap().unwrap().bytes;
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x01;
        repo.overwrite(&key, &bytes).unwrap();
        let config_before = repo.read(&format!("vaecf/{CONFIG_FILE}")).unwrap().unwrap();
        let refused = release::approve(&repo, "vaecf", 2, &Fleet::none(), 32, &mut |_| {}).unwrap();
        let reason = refused.refused.expect("the integrity gate refuses");
        assert!(
            reason.contains("weights.safetensors") && reason.contains("SHA-256"),
            "{reason}"
        );
        let config_after = repo.read(&format!("vaecf/{CONFIG_FILE}")).unwrap().unwrap();
        assert_eq!(config_before.bytes, config_after.bytes, "nothing changes");
        let listed = versions::list(&repo, "vaecf").unwrap();
        assert_eq!(listed[1].status, Status::Pending);
        assert!(listed[1]
            .last_failure
            .as_deref()
            .is_some_and(|f| f.contains("approve refused")));
        // A missing file and an extra one are named too.
        repo.delete(&key).unwrap();
        let reason = release::approve(&repo, "vaecf", 2, &Fleet::none(), 32, &mut |_| {})
            .unwrap()
            .refused
            .unwrap();
        assert!(
            reason.contains("weights.safetensors is missing"),
            "{reason}"
        );
        repo.overwrite("vaecf/1/stray.bin", b"x").unwrap();
        let err = release::approve(&repo, "vaecf", 1, &Fleet::none(), 32, &mut |_| {});
        // v1 already serves: re-approving it changes nothing and runs no gate.
        assert!(err.unwrap().refused.is_none());
        assert_eq!(served(&repo), [1]);
    }
}

#[test]
fn rollback_serves_an_earlier_approved_version_and_reject_verifies_where_it_goes() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        for _ in 0..3 {
            publish_approved(&repo, &engine);
        }
        assert_eq!(served(&repo), [3]);
        let back = release::rollback(&repo, "vaecf", None, &Fleet::none(), &mut |_| {}).unwrap();
        assert_eq!((back.serving_before, back.serving), (Some(3), Some(2)));
        assert_eq!(served(&repo), [2]);
        let back = release::rollback(&repo, "vaecf", Some(1), &Fleet::none(), &mut |_| {}).unwrap();
        assert_eq!(back.serving, Some(1));
        let statuses: Vec<Status> = versions::list(&repo, "vaecf")
            .unwrap()
            .iter()
            .map(|v| v.status)
            .collect();
        assert_eq!(
            statuses,
            [Status::Approved, Status::RolledBack, Status::RolledBack]
        );
        let err = release::rollback(&repo, "vaecf", None, &Fleet::none(), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("no approved version older"), "{err}");
        let err = release::rollback(&repo, "vaecf", Some(3), &Fleet::none(), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("rolled-back, not approved"), "{err}");
        // Approving 3 again runs its gates and serves it; rejecting it goes back to 1, verified.
        release::approve(&repo, "vaecf", 3, &Fleet::none(), 32, &mut |_| {}).unwrap();
        assert_eq!(served(&repo), [3]);
        repo.overwrite("vaecf/1/item_ids.tsv", b"corrupt").unwrap();
        let refused = release::reject(&repo, "vaecf", 3, &Fleet::none(), &mut |_| {}).unwrap();
        assert!(
            refused
                .refused
                .as_deref()
                .is_some_and(|r| r.contains("version 1")),
            "{:?}",
            refused.refused
        );
        assert_eq!(served(&repo), [3], "a refused reject changes nothing");
        assert_eq!(
            versions::list(&repo, "vaecf").unwrap()[2].status,
            Status::Approved
        );
    }
}

#[test]
fn prune_removes_old_versions_but_never_one_that_serves_or_may_serve_next() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        for _ in 0..4 {
            publish_approved(&repo, &engine);
        }
        publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        set_status(&repo, "vaecf", 2, Status::Rejected).unwrap();
        // 1 approved, 2 rejected, 3 approved (previous), 4 approved (serving), 5 pending.
        let dry = prune(&repo, 1, true, &mut |_| {}).unwrap();
        assert_eq!(dry.removed, [1, 2]);
        assert_eq!(versions::numbers(&repo, "vaecf").unwrap(), [1, 2, 3, 4, 5]);
        let mut heard = Vec::new();
        let done = prune(&repo, 1, false, &mut |v| heard.push(v)).unwrap();
        assert_eq!((done.removed.clone(), heard), (vec![1, 2], vec![1, 2]));
        assert_eq!(versions::numbers(&repo, "vaecf").unwrap(), [3, 4, 5]);
        assert!(repo.files("vaecf/1").unwrap().is_empty());
        assert_eq!(served(&repo), [4]);
    }
}

fn prune(
    repo: &Repository,
    keep: usize,
    dry_run: bool,
    on_removed: &mut dyn FnMut(u64),
) -> recsys_registry::Result<recsys_registry::prune::Pruned> {
    recsys_registry::prune::prune(
        repo,
        &recsys_registry::prune::PruneRequest {
            model: "vaecf",
            keep,
            dry_run,
            replicas: &[],
            lease: Fleet::none().lease,
        },
        &mut |_, _| {},
        on_removed,
    )
}

#[test]
fn prune_after_a_rollback_killed_between_its_writes_refuses_and_never_takes_the_configs_version() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        for _ in 0..4 {
            publish_approved(&repo, &engine);
        }
        // A rollback from 4 killed after its record write, before its config write.
        versions::update(&repo, "vaecf", 4, &mut |_, v| {
            v.status = Status::RolledBack;
            Ok(())
        })
        .unwrap();
        publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        assert_eq!(served(&repo), [4]);
        let err = prune(&repo, 1, false, &mut |_| {}).unwrap_err().to_string();
        assert!(
            err.contains("names version(s) [4]")
                && err.contains("recsys approve --repository")
                && err.contains("--version 3"),
            "{err}"
        );
        assert_eq!(versions::numbers(&repo, "vaecf").unwrap(), [1, 2, 3, 4, 5]);
        // The repair the refusal names, then the prune.
        let repaired =
            release::approve(&repo, "vaecf", 3, &Fleet::none(), 32, &mut |_| {}).unwrap();
        assert_eq!(repaired.serving, Some(3));
        let done = prune(&repo, 1, false, &mut |_| {}).unwrap();
        assert_eq!(done.removed, [1, 4]);
        assert_eq!(versions::numbers(&repo, "vaecf").unwrap(), [2, 3, 5]);
        assert_eq!(served(&repo), [3]);
    }
}

#[test]
fn a_folder_without_a_record_is_incomplete_and_cannot_be_approved() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        publish_approved(&repo, &engine);
        // What `recsys convert --output <repo>/vaecf/2` leaves (or is in the middle of writing):
        // an engine, no record.
        for (name, _) in std::fs::read_dir(&engine)
            .unwrap()
            .map(|e| (e.unwrap().file_name().into_string().unwrap(), ()))
        {
            repo.upload(&format!("vaecf/2/{name}"), &engine.join(&name), &mut |_| {})
                .unwrap();
        }
        let listed = versions::list(&repo, "vaecf").unwrap();
        assert_eq!(listed[1].status, Status::Incomplete);
        assert!(listed[1].history[0].contains("without `recsys publish`"));
        let err = release::approve(&repo, "vaecf", 2, &Fleet::none(), 32, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("incomplete") && err.contains("recsys publish"),
            "{err}"
        );
        assert_eq!(served(&repo), [1]);
    }
}

#[test]
fn approve_verifies_the_version_the_config_will_name() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        publish_approved(&repo, &engine);
        publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        // v3 approved by an approve killed before its config write, then corrupted in the store.
        versions::update(&repo, "vaecf", 3, &mut |_, v| {
            v.status = Status::Approved;
            Ok(())
        })
        .unwrap();
        repo.overwrite("vaecf/3/weights.safetensors", b"rotten")
            .unwrap();
        // Approving v2 would have the config name v3, the newest approved: v3 is what is gated.
        let refused = release::approve(&repo, "vaecf", 2, &Fleet::none(), 32, &mut |_| {}).unwrap();
        let reason = refused.refused.expect("the target's gate refuses");
        assert!(reason.contains("weights.safetensors"), "{reason}");
        assert_eq!(served(&repo), [1]);
    }
}

#[test]
fn a_command_finding_the_lease_held_fails_naming_the_holder_and_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        publish_approved(&repo, &engine);
        publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        let held = recsys_registry::lease::acquire(
            &repo,
            "vaecf",
            &recsys_registry::lease::LeaseOptions {
                command: "rollback --to 1".into(),
                ..Fleet::none().lease
            },
            &mut |_| {},
        )
        .unwrap();
        let err = release::approve(&repo, "vaecf", 2, &Fleet::none(), 32, &mut |_| {}).unwrap_err();
        assert!(
            matches!(err, recsys_registry::RegistryError::LeaseHeld(_)),
            "{err}"
        );
        assert!(err.to_string().contains("rollback --to 1"), "{err}");
        let err = prune(&repo, 1, false, &mut |_| {}).unwrap_err();
        assert!(matches!(err, recsys_registry::RegistryError::LeaseHeld(_)));
        assert_eq!(served(&repo), [1]);
        assert_eq!(
            versions::list(&repo, "vaecf").unwrap()[1].status,
            Status::Pending
        );
        held.release().unwrap();
        release::approve(&repo, "vaecf", 2, &Fleet::none(), 32, &mut |_| {}).unwrap();
        assert_eq!(served(&repo), [2]);
        assert!(lease_free(&repo));
    }
}

#[test]
fn an_evaluation_set_is_published_with_the_version_and_checked_like_its_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    let test_set = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/test_set.tsv");
    // A set whose items are not this engine's is refused before anything is written.
    let foreign = tmp.path().join("foreign.tsv");
    std::fs::write(&foreign, "u1\t999999\t888888 777777\nu2\t999998\t888887\n").unwrap();
    for repo in repositories(tmp.path()) {
        publish_approved(&repo, &engine);
        let err = publish(
            &repo,
            &PublishRequest {
                eval_set: Some(&foreign),
                ..request(&engine, false)
            },
            &mut |_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("not an evaluation set for this engine"),
            "{err}"
        );
        assert_eq!(versions::numbers(&repo, "vaecf").unwrap(), [1]);

        let info = publish(
            &repo,
            &PublishRequest {
                eval_set: Some(&test_set),
                ..request(&engine, false)
            },
            &mut |_, _| {},
        )
        .unwrap();
        let key = format!("vaecf/2/{}", recsys_registry::quality::EVAL_SET_FILE);
        assert_eq!(
            repo.read(&key).unwrap().unwrap().bytes,
            std::fs::read(&test_set).unwrap()
        );
        assert!(info
            .files
            .iter()
            .any(|(name, _)| name == recsys_registry::quality::EVAL_SET_FILE));
        // A changed evaluation set fails the integrity gate like a changed weight file.
        repo.overwrite(&key, b"u\t1\t2\n").unwrap();
        let refused = release::approve(&repo, "vaecf", 2, &Fleet::none(), 32, &mut |_| {}).unwrap();
        let reason = refused.refused.expect("the integrity gate refuses");
        assert!(
            reason.contains(recsys_registry::quality::EVAL_SET_FILE),
            "{reason}"
        );
    }
}

#[test]
fn approve_and_reject_keep_every_field_of_a_config_whose_comments_and_strings_mention_the_policy() {
    // A comment naming `version_policy` before the real field, a string holding a brace, and a
    // comment with a brace inside the policy block: only the top-level field is the policy.
    let written = "# version_policy below is managed by recsys\n\
                   name: \"vaecf\"\n\
                   backend: \"recsys\"\n\
                   max_batch_size: 16\n\
                   parameters { key: \"note\" value { string_value: \"version_policy { x\" } }\n\
                   version_policy: { specific: { versions: [ 1 ] } } # } closed above\n\
                   dynamic_batching { }\n";
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        publish_approved(&repo, &engine);
        repo.overwrite(&format!("vaecf/{CONFIG_FILE}"), written.as_bytes())
            .unwrap();
        publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        release::approve(&repo, "vaecf", 2, &Fleet::none(), 32, &mut |_| {}).unwrap();
        assert_eq!(served(&repo), [2]);
        let rejected = release::reject(&repo, "vaecf", 2, &Fleet::none(), &mut |_| {}).unwrap();
        assert_eq!(rejected.serving, Some(1));
        let config = repo.read(&format!("vaecf/{CONFIG_FILE}")).unwrap().unwrap();
        let text = String::from_utf8(config.bytes).unwrap();
        assert_eq!(policy_versions(&text), Some(vec![1]), "{text}");
        assert_eq!(text.matches("version_policy:").count(), 1, "{text}");
        for kept in [
            "# version_policy below is managed by recsys",
            "backend: \"recsys\"",
            "max_batch_size: 16",
            "string_value: \"version_policy { x\" } }",
            "dynamic_batching { }",
        ] {
            assert!(text.contains(kept), "lost `{kept}`:\n{text}");
        }
        let fields = recsys_registry::config::top_level_fields(&text);
        let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "name",
                "backend",
                "max_batch_size",
                "parameters",
                "dynamic_batching",
                "version_policy"
            ],
            "{text}"
        );
    }
}

/// Takes the lease on vaecf over with `--force` from a second handle on the store, as an operator
/// in another process would.
fn force_over(other: &Repository) -> recsys_registry::lease::Lease<'_> {
    recsys_registry::lease::acquire(
        other,
        "vaecf",
        &recsys_registry::lease::LeaseOptions {
            command: "rollback --force".into(),
            force: true,
            ..Fleet::none().lease
        },
        &mut |_| {},
    )
    .unwrap()
}

/// The command stopped on its lost lease: failed with `LeaseLost` before its first write, or
/// reported it (`lease_lost`) once its report had begun (reject and rollback halt and report).
fn assert_lease_lost(outcome: recsys_registry::Result<Option<String>>) {
    let why = match outcome {
        Err(recsys_registry::RegistryError::LeaseLost(why)) | Ok(Some(why)) => why,
        Err(other) => panic!("not a lost lease: {other}"),
        Ok(None) => panic!("the command went on without its lease"),
    };
    assert!(why.contains("rollback --force"), "{why}");
}

#[test]
fn a_command_whose_lease_is_forced_over_during_its_gates_writes_nothing_more() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        let other = repo.another_handle().unwrap();
        for _ in 0..2 {
            publish_approved(&repo, &engine);
        }
        publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        let before = statuses(&repo);
        assert_eq!(
            before,
            [Status::Approved, Status::Approved, Status::Pending]
        );

        // Each command loses its lease while its integrity gate runs (the long step before its
        // writes): none of them may mark a version or switch the config afterwards.
        for command in ["approve", "reject", "rollback"] {
            let mut taken = None;
            let mut on_step = |step: release::Step<'_>| {
                if matches!(step, release::Step::Verified { .. }) && taken.is_none() {
                    taken = Some(force_over(&other));
                }
            };
            let outcome = match command {
                "approve" => release::approve(&repo, "vaecf", 3, &Fleet::none(), 32, &mut on_step),
                "reject" => release::reject(&repo, "vaecf", 2, &Fleet::none(), &mut on_step),
                _ => release::rollback(&repo, "vaecf", None, &Fleet::none(), &mut on_step),
            }
            .map(|release| release.lease_lost);
            assert!(taken.is_some(), "{command} ran its gate");
            assert_lease_lost(outcome);
            assert_eq!(statuses(&repo), before, "{command} changed a record");
            assert_eq!(served(&repo), [2], "{command} switched the config");
            // The holder's lease stands until it releases it.
            assert_eq!(
                recsys_registry::lease::current(&repo, "vaecf")
                    .unwrap()
                    .unwrap()
                    .command,
                "rollback --force"
            );
        }

        // prune loses its lease after its first removal: the second version stays.
        for _ in 0..2 {
            publish_approved(&repo, &engine);
        }
        // 1, 2 approved; 3 pending; 4 previous; 5 serving: prune --keep 1 would remove 1 and 2.
        assert_eq!(prune(&repo, 1, true, &mut |_| {}).unwrap().removed, [1, 2]);
        let mut taken = None;
        let outcome = prune(&repo, 1, false, &mut |_| {
            taken.get_or_insert_with(|| force_over(&other));
        });
        assert_lease_lost(outcome.map(|_| None));
        drop(taken);
        assert_eq!(versions::numbers(&repo, "vaecf").unwrap(), [2, 3, 4, 5]);
        assert!(!repo.files("vaecf/2").unwrap().is_empty());
    }
}

#[test]
fn an_empty_replica_list_fails_every_command_before_anything_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    let list = tmp.path().join("replicas.txt");
    for repo in repositories(tmp.path()) {
        for _ in 0..2 {
            publish_approved(&repo, &engine);
        }
        publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        for text in ["", "\n  \n", "# rewritten by the agent\n"] {
            std::fs::write(&list, text).unwrap();
            let fleet = Fleet {
                servers_file: Some(&list),
                ..Fleet::none()
            };
            let outcomes = [
                release::rollback(&repo, "vaecf", None, &fleet, &mut |_| {}).map(|_| ()),
                release::reject(&repo, "vaecf", 2, &fleet, &mut |_| {}).map(|_| ()),
                release::approve(&repo, "vaecf", 3, &fleet, 32, &mut |_| {}).map(|_| ()),
            ];
            for outcome in outcomes {
                let err = outcome.unwrap_err().to_string();
                assert!(
                    err.contains("replicas.txt names no replica") && err.contains("--server"),
                    "{err}"
                );
            }
            assert_eq!(served(&repo), [2]);
            assert_eq!(
                statuses(&repo),
                [Status::Approved, Status::Approved, Status::Pending]
            );
            assert!(lease_free(&repo));
        }
    }
}

#[test]
fn an_unusable_max_ndcg_drop_is_refused_before_anything_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    let repo = Repository::in_memory();
    publish_approved(&repo, &engine);
    publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
    for bad in [5.0, f64::NAN, -0.1] {
        let fleet = Fleet {
            quality: recsys_registry::quality::QualityOptions {
                max_drop: bad,
                ..Default::default()
            },
            ..Fleet::none()
        };
        let err = release::approve(&repo, "vaecf", 2, &fleet, 32, &mut |_| {}).unwrap_err();
        assert!(
            matches!(err, recsys_registry::RegistryError::Usage(_)),
            "{bad}: {err}"
        );
        assert_eq!(served(&repo), [1]);
    }
}

#[test]
fn publish_after_a_rollback_killed_between_its_writes_says_what_state_the_repository_is_in() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = engine(tmp.path());
    for repo in repositories(tmp.path()) {
        publish_approved(&repo, &engine);
        // The served version's record says rolled-back; the config still names it.
        versions::update(&repo, "vaecf", 1, &mut |_, v| {
            v.status = Status::RolledBack;
            Ok(())
        })
        .unwrap();
        let err = publish(&repo, &request(&engine, false), &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(!err.contains("first version"), "{err}");
        for says in [
            "versions: 1 rolled-back",
            "still names version 1",
            "stopped between its record write and its config write",
            "recsys approve --repository",
            "--model vaecf --version 1",
        ] {
            assert!(err.contains(says), "{says}: {err}");
        }
        // The repair it names works, and then the publish.
        release::approve(&repo, "vaecf", 1, &Fleet::none(), 32, &mut |_| {}).unwrap();
        let second = publish(&repo, &request(&engine, false), &mut |_, _| {}).unwrap();
        assert_eq!(second.version, 2);
    }
}
