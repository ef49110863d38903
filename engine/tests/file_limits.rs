//! Size limits on checkpoints and engines, and engine files confined to their directory.

mod common;

use std::os::unix::fs::symlink;

use common::{convert_fixture, model_dir};
use recsys_engine::import::Checkpoint;
use recsys_engine::{engine_dir, Engine, EngineError, ModelKind};

#[test]
fn a_checkpoint_over_the_limit_is_refused_before_it_is_read() {
    let path = model_dir(ModelKind::Vaecf).join("model.safetensors");
    let size = std::fs::metadata(&path).unwrap().len();
    let err = Checkpoint::load_limited(&path, size - 1).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&format!(
            "the file is {size} bytes, more than the limit of {}",
            size - 1
        )),
        "{msg}"
    );
    assert!(msg.contains("--max-checkpoint-bytes"), "{msg}");
    assert!(Checkpoint::load_limited(&path, size).is_ok());
}

#[test]
fn an_engine_over_the_limit_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("e");
    convert_fixture(ModelKind::Vaecf, "model.safetensors", &dir);
    let manifest = engine_dir::load(&dir).unwrap().manifest;
    let total: u64 = manifest.files.values().map(|f| f.bytes).sum();
    let msg = match Engine::load_limited(&dir, total - 1) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("an engine over the limit loaded"),
    };
    assert!(
        msg.contains(&format!(
            "hold {total} bytes, more than the limit of {}",
            total - 1
        )),
        "{msg}"
    );
    assert!(msg.contains("max_engine_bytes"), "{msg}");
    assert!(Engine::load_limited(&dir, total).is_ok());
}

#[test]
fn engine_files_may_not_be_symlinks_out_of_the_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("engine");
    convert_fixture(ModelKind::Vaecf, "model.safetensors", &dir);
    // A symlink that stays inside the directory is fine (same bytes, same checksum).
    std::fs::rename(dir.join("item_ids.tsv"), dir.join("ids-real.tsv")).unwrap();
    symlink("ids-real.tsv", dir.join("item_ids.tsv")).unwrap();
    assert!(Engine::load(&dir).is_ok());
    // One that leaves it is refused, whatever it points to.
    let outside = tmp.path().join("outside.tsv");
    std::fs::rename(dir.join("ids-real.tsv"), &outside).unwrap();
    std::fs::remove_file(dir.join("item_ids.tsv")).unwrap();
    symlink(&outside, dir.join("item_ids.tsv")).unwrap();
    match Engine::load(&dir) {
        Err(EngineError::EngineDir { reason, .. }) => {
            assert!(reason.contains("outside the engine directory"), "{reason}")
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    // The directory itself may be reached through a symlink (version directories often are).
    let link = tmp.path().join("linked");
    std::fs::remove_file(dir.join("item_ids.tsv")).unwrap();
    std::fs::rename(&outside, dir.join("item_ids.tsv")).unwrap();
    symlink(&dir, &link).unwrap();
    assert!(Engine::load(&link).is_ok());
}
