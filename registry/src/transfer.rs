//! Files and folders between this machine and object storage, for the commands that read or write
//! one object-store path (`convert --output s3://...`, `predict --engine/--input/--output s3://...`,
//! `export-onnx --model-repository s3://...`). Each upload appears whole: single puts, or multipart
//! uploads completed last.

use std::path::{Path, PathBuf};

use crate::error::{RegistryError, Result};
use crate::store::Repository;

/// Whether `text` names object storage (`s3://`, `gs://`) rather than a local path.
pub fn is_remote(text: &str) -> bool {
    text.starts_with("s3://") || text.starts_with("gs://")
}

/// `s3://bucket/a/b/file` -> (`s3://bucket/a/b`, `file`).
fn parent_and_name(uri: &str) -> Result<(&str, &str)> {
    let trimmed = uri.trim_end_matches('/');
    match trimmed.rsplit_once('/') {
        Some((parent, name))
            if !name.is_empty()
                && if is_remote(uri) {
                    parent
                        .split_once("://")
                        .is_some_and(|(_, bucket)| !bucket.is_empty())
                } else {
                    !parent.is_empty()
                } =>
        {
            Ok((parent, name))
        }
        _ => Err(RegistryError::Usage(format!(
            "{uri} names a bucket, not an object in it"
        ))),
    }
}

/// Downloads the object `uri` to the local file `to`.
pub fn download_file(uri: &str, to: &Path) -> Result<u64> {
    let (parent, name) = parent_and_name(uri)?;
    Repository::open(parent)?.download(name, to)
}

/// Uploads the local file `from` as the object `uri`.
pub fn upload_file(from: &Path, uri: &str, progress: &mut dyn FnMut(u64)) -> Result<u64> {
    let (parent, name) = parent_and_name(uri)?;
    Repository::open(parent)?.upload(name, from, progress)
}

/// The objects under the folder `uri`, as (relative path, size).
pub fn list_folder(uri: &str) -> Result<Vec<(String, u64)>> {
    Repository::open(uri)?.files("")
}

/// Downloads every object under the folder `uri` into the local folder `to` (created).
pub fn download_folder(uri: &str, to: &Path) -> Result<u64> {
    let repo = Repository::open(uri)?;
    let files = repo.files("")?;
    if files.is_empty() {
        return Err(RegistryError::Input(format!("{uri} holds no objects")));
    }
    let mut total = 0;
    for (relative, _) in files {
        let target: PathBuf = to.join(&relative);
        if let Some(dir) = target.parent() {
            std::fs::create_dir_all(dir).map_err(RegistryError::io(format!(
                "cannot create {}",
                dir.display()
            )))?;
        }
        total += repo.download(&relative, &target)?;
    }
    Ok(total)
}

/// Every file under the local folder `dir`, as (path relative to it with `/`, local path, size),
/// sorted.
pub fn local_files(dir: &Path) -> Result<Vec<(String, PathBuf, u64)>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf, u64)>) -> Result<()> {
        for entry in std::fs::read_dir(dir)
            .map_err(RegistryError::io(format!("cannot read {}", dir.display())))?
        {
            let entry =
                entry.map_err(RegistryError::io(format!("cannot list {}", dir.display())))?;
            let path = entry.path();
            let meta = entry
                .metadata()
                .map_err(RegistryError::io(format!("cannot stat {}", path.display())))?;
            if meta.is_dir() {
                walk(root, &path, out)?;
                continue;
            }
            let relative = path
                .strip_prefix(root)
                .expect("walked from the root")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push((relative, path, meta.len()));
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort();
    Ok(out)
}

/// Uploads every file under the local folder `from` to the folder `uri`.
pub fn upload_folder(from: &Path, uri: &str, progress: &mut dyn FnMut(u64)) -> Result<u64> {
    let repo = Repository::open(uri)?;
    let mut done = 0;
    for (relative, path, _) in local_files(from)? {
        let base = done;
        done += repo.upload(&relative, &path, &mut |n| progress(base + n))?;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_paths_split_into_folder_and_name() {
        assert_eq!(
            parent_and_name("s3://b/a/f.jsonl").unwrap(),
            ("s3://b/a", "f.jsonl")
        );
        assert_eq!(
            parent_and_name("s3://h:9000/b/f").unwrap(),
            ("s3://h:9000/b", "f")
        );
        assert!(parent_and_name("s3://b").is_err());
        assert!(is_remote("gs://b/x") && !is_remote("/tmp/x"));
    }

    #[test]
    fn folders_go_up_and_come_back_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let from = tmp.path().join("from");
        std::fs::create_dir_all(from.join("sub")).unwrap();
        std::fs::write(from.join("a.txt"), b"alpha").unwrap();
        std::fs::write(from.join("sub/b.bin"), vec![7u8; 1000]).unwrap();
        let remote = tmp.path().join("store/folder");
        let remote = remote.to_str().unwrap();
        assert_eq!(upload_folder(&from, remote, &mut |_| {}).unwrap(), 1005);
        assert_eq!(
            list_folder(remote).unwrap(),
            [("a.txt".to_string(), 5), ("sub/b.bin".to_string(), 1000)]
        );
        let back = tmp.path().join("back");
        download_folder(remote, &back).unwrap();
        assert_eq!(
            std::fs::read(back.join("sub/b.bin")).unwrap(),
            vec![7u8; 1000]
        );
        let file = tmp.path().join("one.txt");
        download_file(&format!("{remote}/a.txt"), &file).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"alpha");
    }
}
