//! A model repository as a set of objects: the few operations the registry needs (read, create if
//! absent, replace if unchanged, upload, list), blocking, over object_store. Keys are `/`-separated
//! and relative to the repository root (`bert4rec/config.pbtxt`, `bert4rec/3/weights.safetensors`).

use std::io::{Read, Write};
use std::path::Path as LocalPath;
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::prefix::PrefixStore;
use object_store::{
    ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion, WriteMultipart,
};

use crate::aws_files;
use crate::error::{RegistryError, Result};
use crate::faults;
use crate::location::Location;

/// Files up to this size go up in one request; larger ones in parts of this size (S3's minimum
/// part is 5 MiB), at most a few parts in flight, so memory stays bounded for any engine size.
const PART_BYTES: usize = 16 << 20;
const PARTS_IN_FLIGHT: usize = 4;

/// One object as read, with what a conditional replace needs to know it is unchanged.
#[derive(Clone, Debug)]
pub struct Object {
    pub bytes: Vec<u8>,
    version: UpdateVersion,
}

impl Object {
    /// The store's entity tag of the object as read (`None` where the store keeps none).
    pub fn etag(&self) -> Option<&str> {
        self.version.e_tag.as_deref()
    }
}

/// What [`Repository::read_if_changed`] found.
#[derive(Debug)]
pub enum Fetched {
    /// The object still carries the entity tag the caller holds.
    Unchanged,
    /// There is no object at the key.
    Missing,
    Changed(Object),
    /// A bounded read ([`Repository::read_if_changed_within`]) stopped: the object is larger
    /// than the bound (known from its metadata, before any of it is read) or its first bytes
    /// fail the caller's check. `etag` is the refused object's, so a poller does not read it
    /// again until it changes.
    Refused {
        why: String,
        etag: Option<String>,
    },
}

/// Called as an object's bytes arrive with what has arrived and the object's size: `Ok(Some(n))`
/// while it needs the first `n` bytes, `Ok(None)` once they are good, `Err(why)` to stop reading.
pub type HeadCheck<'a> = &'a dyn Fn(&[u8], u64) -> std::result::Result<Option<usize>, String>;

/// How much of an object a bounded read takes, and what its first bytes must be.
pub struct ReadBound<'a> {
    /// The most bytes the object may hold.
    pub max_bytes: u64,
    pub check_head: HeadCheck<'a>,
}

/// The longest one store request may take, its retries included: each attempt times out after
/// [`REQUEST_TIMEOUT`] and no retry starts after [`RETRY_TIMEOUT`]. Bounded so that a write that
/// passed its lease check lands while the lease still holds (object_store's own default lets
/// retries run for three minutes, past a lease's lifetime).
pub const STORE_REQUEST_BOUND: std::time::Duration =
    std::time::Duration::from_secs(REQUEST_TIMEOUT.as_secs() + RETRY_TIMEOUT.as_secs());
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
const RETRY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

fn retry() -> object_store::RetryConfig {
    object_store::RetryConfig {
        retry_timeout: RETRY_TIMEOUT,
        ..Default::default()
    }
}

/// A true setting as the AWS SDKs and object_store spell one.
fn truthy(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "on" | "yes" | "y"
    )
}

fn client_options() -> object_store::ClientOptions {
    object_store::ClientOptions::new().with_timeout(REQUEST_TIMEOUT)
}

/// A check every write through a repository handle makes first (the lease of the command that
/// holds it: renewed by compare-and-swap, refusing once lost). Writes to the fence's own key
/// (the lease object) do not run it.
pub trait WriteFence: Send + Sync {
    fn key(&self) -> &str;
    fn before_write(&self, repo: &Repository) -> Result<()>;
}

/// A repository opened for reading and writing.
pub struct Repository {
    store: Arc<dyn ObjectStore>,
    runtime: tokio::runtime::Runtime,
    text: String,
    location: Location,
    fences: std::sync::Mutex<Vec<Arc<dyn WriteFence>>>,
}

impl std::fmt::Debug for Repository {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(RegistryError::io("cannot start the object-store client"))
}

fn s3_store(endpoint: &Option<String>, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    // The client options below replace the ones `from_env` read, so the environment's choice of a
    // plain-HTTP endpoint (AWS_ALLOW_HTTP, as a local MinIO or moto needs) is carried over here.
    let allow_http = std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| truthy(&v));
    let mut builder = object_store::aws::AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_retry(retry())
        .with_client_options(client_options().with_allow_http(allow_http));
    if let Some(endpoint) = endpoint {
        builder = builder
            .with_endpoint(endpoint)
            .with_allow_http(endpoint.starts_with("http://"))
            .with_virtual_hosted_style_request(false);
    }
    // The environment wins (as for the AWS SDKs); the shared files fill what it leaves out.
    let profile = aws_files::profile();
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
        if let (Some(id), Some(secret)) = (profile.access_key_id, profile.secret_access_key) {
            builder = builder
                .with_access_key_id(id)
                .with_secret_access_key(secret);
            if let Some(token) = profile.session_token {
                builder = builder.with_token(token);
            }
        }
    }
    if std::env::var_os("AWS_DEFAULT_REGION").is_none() && std::env::var_os("AWS_REGION").is_none()
    {
        builder = builder.with_region(profile.region.unwrap_or_else(|| "us-east-1".into()));
    }
    let store = builder.build().map_err(RegistryError::store(format!(
        "cannot open S3 bucket {bucket}"
    )))?;
    Ok(Arc::new(store))
}

fn gcs_store(bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    let store = object_store::gcp::GoogleCloudStorageBuilder::from_env()
        .with_bucket_name(bucket)
        .with_retry(retry())
        .with_client_options(client_options())
        .build()
        .map_err(RegistryError::store(format!(
            "cannot open GCS bucket {bucket}"
        )))?;
    Ok(Arc::new(store))
}

fn with_prefix(store: Arc<dyn ObjectStore>, prefix: &str) -> Arc<dyn ObjectStore> {
    if prefix.is_empty() {
        store
    } else {
        Arc::new(PrefixStore::new(store, prefix))
    }
}

impl Repository {
    /// Opens the repository at `text` (see [`Location`]); a local directory is created if missing.
    pub fn open(text: &str) -> Result<Repository> {
        // rustls needs one process-wide crypto provider; a second install is a no-op.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let location = Location::parse(text)?;
        let store: Arc<dyn ObjectStore> = match &location {
            Location::Local(dir) => {
                std::fs::create_dir_all(dir).map_err(RegistryError::io(format!(
                    "cannot create {}",
                    dir.display()
                )))?;
                let dir = std::fs::canonicalize(dir)
                    .map_err(RegistryError::io(format!("cannot open {}", dir.display())))?;
                Arc::new(
                    object_store::local::LocalFileSystem::new_with_prefix(&dir).map_err(
                        RegistryError::store(format!("cannot open {}", dir.display())),
                    )?,
                )
            }
            Location::S3 {
                endpoint,
                bucket,
                prefix,
            } => with_prefix(s3_store(endpoint, bucket)?, prefix),
            Location::Gcs { bucket, prefix } => with_prefix(gcs_store(bucket)?, prefix),
        };
        Ok(Repository {
            store,
            runtime: runtime()?,
            text: text.to_string(),
            location,
            fences: Default::default(),
        })
    }

    /// A repository held in memory (tests of the registry's own logic).
    pub fn in_memory() -> Repository {
        Repository {
            store: Arc::new(object_store::memory::InMemory::new()),
            runtime: runtime().expect("a current-thread runtime starts"),
            text: "memory://".into(),
            location: Location::Local("memory".into()),
            fences: Default::default(),
        }
    }

    /// A second handle on the same store, as another process would open it: its own client
    /// runtime and no write fences of this one's.
    pub fn another_handle(&self) -> Result<Repository> {
        Ok(Repository {
            store: self.store.clone(),
            runtime: runtime()?,
            text: self.text.clone(),
            location: self.location.clone(),
            fences: Default::default(),
        })
    }

    /// Every later write through this handle runs `fence` first (see [`WriteFence`]).
    pub fn add_write_fence(&self, fence: Arc<dyn WriteFence>) {
        self.fences.lock().expect("write fences").push(fence);
    }

    /// Drops `fence` (its lease released); other fences stay.
    pub fn remove_write_fence(&self, fence: &dyn WriteFence) {
        self.fences
            .lock()
            .expect("write fences")
            .retain(|f| !std::ptr::addr_eq(Arc::as_ptr(f), fence as *const dyn WriteFence));
    }

    /// Runs the write fences before a write to `key`. The list is copied out first: a fence
    /// writes through this handle itself (the lease's renewal), which must not wait on the lock.
    fn fenced(&self, key: &str) -> Result<()> {
        let fences: Vec<Arc<dyn WriteFence>> = self.fences.lock().expect("write fences").clone();
        for fence in fences.iter().filter(|f| f.key() != key) {
            fence.before_write(self)?;
        }
        Ok(())
    }

    /// The location as given (what tritonserver's `--model-repository` takes).
    pub fn uri(&self) -> &str {
        &self.text
    }

    pub fn location(&self) -> &Location {
        &self.location
    }

    fn describe(&self, key: &str) -> String {
        format!("{}/{key}", self.text.trim_end_matches('/'))
    }

    /// The object at `key`, or `None` when there is none.
    pub fn read(&self, key: &str) -> Result<Option<Object>> {
        Ok(match self.read_if_changed(key, None)? {
            Fetched::Changed(object) => Some(object),
            // Without a tag to compare, the store never answers "not modified".
            Fetched::Missing | Fetched::Unchanged => None,
            Fetched::Refused { why, .. } => return Err(RegistryError::Input(why)),
        })
    }

    /// [`Repository::read_if_changed`] within `bound`: an object larger than `bound.max_bytes`
    /// is refused from its metadata before its body is requested past the first chunk, and one
    /// whose first bytes fail `bound.check_head` as soon as they arrive; a store whose stream
    /// runs past the size it announced is cut off at the bound. Memory stays within the bound
    /// whatever is at the key.
    pub fn read_if_changed_within(
        &self,
        key: &str,
        known: Option<&str>,
        bound: &ReadBound<'_>,
    ) -> Result<Fetched> {
        let path = Path::from(key);
        let options = object_store::GetOptions {
            if_none_match: known.map(str::to_owned),
            ..Default::default()
        };
        let context = || format!("cannot read {}", self.describe(key));
        self.runtime.block_on(async {
            let result = match self.store.get_opts(&path, options).await {
                Ok(result) => result,
                Err(object_store::Error::NotModified { .. }) => return Ok(Fetched::Unchanged),
                Err(object_store::Error::NotFound { .. }) => return Ok(Fetched::Missing),
                Err(e) => return Err(RegistryError::store(context())(e)),
            };
            let etag = result.meta.e_tag.clone();
            let version = UpdateVersion {
                e_tag: result.meta.e_tag.clone(),
                version: result.meta.version.clone(),
            };
            let size = result.meta.size;
            let refuse = |why: String| Fetched::Refused {
                why,
                etag: etag.clone(),
            };
            if size > bound.max_bytes {
                return Ok(refuse(format!(
                    "{} holds {size} bytes, more than the {} allowed",
                    self.describe(key),
                    bound.max_bytes
                )));
            }
            let mut bytes = Vec::with_capacity(size as usize);
            // Checked once per chunk until the check has what it needs (it asks for more bytes
            // only while it has fewer than that).
            let mut head_ok = false;
            let mut stream = result.into_stream();
            while let Some(chunk) = stream
                .try_next()
                .await
                .map_err(RegistryError::store(context()))?
            {
                if (bytes.len() + chunk.len()) as u64 > size {
                    return Ok(refuse(format!(
                        "{} sent more than the {size} bytes it announced",
                        self.describe(key)
                    )));
                }
                bytes.extend_from_slice(&chunk);
                if !head_ok {
                    match (bound.check_head)(&bytes, size) {
                        Ok(None) => head_ok = true,
                        Ok(Some(_)) => {}
                        Err(why) => return Ok(refuse(why)),
                    }
                }
            }
            if !head_ok {
                match (bound.check_head)(&bytes, size) {
                    Ok(None) => head_ok = true,
                    Ok(Some(_)) => {}
                    Err(why) => return Ok(refuse(why)),
                }
            }
            if (bytes.len() as u64) < size || !head_ok {
                return Ok(refuse(format!(
                    "{} ended after {} of its {size} bytes",
                    self.describe(key),
                    bytes.len()
                )));
            }
            Ok(Fetched::Changed(Object { bytes, version }))
        })
    }

    /// The object at `key` unless it still carries the entity tag `known` (then nothing is
    /// transferred: the store answers "not modified"), for callers that poll one object.
    pub fn read_if_changed(&self, key: &str, known: Option<&str>) -> Result<Fetched> {
        let path = Path::from(key);
        let options = object_store::GetOptions {
            if_none_match: known.map(str::to_owned),
            ..Default::default()
        };
        self.runtime.block_on(async {
            match self.store.get_opts(&path, options).await {
                Ok(result) => {
                    let version = UpdateVersion {
                        e_tag: result.meta.e_tag.clone(),
                        version: result.meta.version.clone(),
                    };
                    let bytes = result.bytes().await.map_err(RegistryError::store(format!(
                        "cannot read {}",
                        self.describe(key)
                    )))?;
                    Ok(Fetched::Changed(Object {
                        bytes: bytes.to_vec(),
                        version,
                    }))
                }
                Err(object_store::Error::NotModified { .. }) => Ok(Fetched::Unchanged),
                Err(object_store::Error::NotFound { .. }) => Ok(Fetched::Missing),
                Err(e) => Err(RegistryError::store(format!(
                    "cannot read {}",
                    self.describe(key)
                ))(e)),
            }
        })
    }

    /// Writes `bytes` at `key` only if no object is there; `false` when one already was.
    pub fn create(&self, key: &str, bytes: &[u8]) -> Result<bool> {
        self.fenced(key)?;
        faults::before_write(key);
        let options = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let payload = PutPayload::from(bytes.to_vec());
        match self
            .runtime
            .block_on(self.store.put_opts(&Path::from(key), payload, options))
        {
            Ok(_) => {
                faults::after_write(key);
                Ok(true)
            }
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(RegistryError::store(format!(
                "cannot create {} (the store must support create-if-absent writes)",
                self.describe(key)
            ))(e)),
        }
    }

    /// Replaces the object at `key` with `bytes` if it is still `expected`; `false` when another
    /// writer changed it first. Stores without conditional replace (local directories) overwrite;
    /// callers re-read and repair, which converges (see `config::switch`).
    pub fn replace(&self, key: &str, bytes: &[u8], expected: &Object) -> Result<bool> {
        self.fenced(key)?;
        faults::before_write(key);
        let path = Path::from(key);
        let options = PutOptions {
            mode: PutMode::Update(expected.version.clone()),
            ..Default::default()
        };
        let conditional = self.runtime.block_on(self.store.put_opts(
            &path,
            PutPayload::from(bytes.to_vec()),
            options,
        ));
        match conditional {
            Ok(_) => {
                faults::after_write(key);
                Ok(true)
            }
            Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(object_store::Error::NotImplemented { .. }) => {
                self.overwrite_unfenced(key, bytes)?;
                faults::after_write(key);
                Ok(true)
            }
            Err(e) => Err(RegistryError::store(format!(
                "cannot replace {}",
                self.describe(key)
            ))(e)),
        }
    }

    /// Writes `bytes` at `key`, replacing whatever is there (one atomic write).
    pub fn overwrite(&self, key: &str, bytes: &[u8]) -> Result<()> {
        self.fenced(key)?;
        faults::before_write(key);
        self.overwrite_unfenced(key, bytes)?;
        faults::after_write(key);
        Ok(())
    }

    fn overwrite_unfenced(&self, key: &str, bytes: &[u8]) -> Result<()> {
        self.runtime
            .block_on(
                self.store
                    .put(&Path::from(key), PutPayload::from(bytes.to_vec())),
            )
            .map(|_| ())
            .map_err(RegistryError::store(format!(
                "cannot write {}",
                self.describe(key)
            )))
    }

    /// Uploads the local file `from` to `key`, calling `progress` with the bytes sent so far. The
    /// object appears whole or not at all (single put, or a multipart upload completed last).
    pub fn upload(
        &self,
        key: &str,
        from: &LocalPath,
        progress: &mut dyn FnMut(u64),
    ) -> Result<u64> {
        self.fenced(key)?;
        faults::before_write(key);
        let context = || format!("cannot upload {} to {}", from.display(), self.describe(key));
        let mut file = std::fs::File::open(from).map_err(RegistryError::io(context()))?;
        let size = file.metadata().map_err(RegistryError::io(context()))?.len();
        let path = Path::from(key);
        if size as usize <= PART_BYTES {
            let mut bytes = Vec::with_capacity(size as usize);
            file.read_to_end(&mut bytes)
                .map_err(RegistryError::io(context()))?;
            self.runtime
                .block_on(self.store.put(&path, PutPayload::from(bytes)))
                .map_err(RegistryError::store(context()))?;
            progress(size);
            faults::after_write(key);
            return Ok(size);
        }
        self.runtime.block_on(async {
            let upload = self
                .store
                .put_multipart(&path)
                .await
                .map_err(RegistryError::store(context()))?;
            let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
            let mut buffer = vec![0u8; PART_BYTES];
            let mut sent = 0u64;
            loop {
                let n = match file.read(&mut buffer) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) => {
                        let _ = writer.abort().await;
                        return Err(RegistryError::io(context())(e));
                    }
                };
                if let Err(e) = writer.wait_for_capacity(PARTS_IN_FLIGHT).await {
                    let _ = writer.abort().await;
                    return Err(RegistryError::store(context())(e));
                }
                writer.write(&buffer[..n]);
                sent += n as u64;
                progress(sent);
            }
            writer
                .finish()
                .await
                .map_err(RegistryError::store(context()))?;
            faults::after_write(key);
            Ok(sent)
        })
    }

    /// Downloads `key` into the local file `to` (created or truncated).
    pub fn download(&self, key: &str, to: &LocalPath) -> Result<u64> {
        let context = || format!("cannot download {} to {}", self.describe(key), to.display());
        self.runtime.block_on(async {
            let result = self
                .store
                .get(&Path::from(key))
                .await
                .map_err(RegistryError::store(context()))?;
            let mut file = std::fs::File::create(to).map_err(RegistryError::io(context()))?;
            let mut stream = result.into_stream();
            let mut written = 0u64;
            while let Some(chunk) = stream
                .try_next()
                .await
                .map_err(RegistryError::store(context()))?
            {
                file.write_all(&chunk)
                    .map_err(RegistryError::io(context()))?;
                written += chunk.len() as u64;
            }
            file.sync_all().map_err(RegistryError::io(context()))?;
            Ok(written)
        })
    }

    /// The size and SHA-256 (hex) of the object at `key`, read as a stream (memory stays bounded
    /// for any size); `None` when there is no such object.
    pub fn sha256(&self, key: &str) -> Result<Option<(u64, String)>> {
        use sha2::{Digest, Sha256};
        let context = || format!("cannot read {}", self.describe(key));
        self.runtime.block_on(async {
            let result = match self.store.get(&Path::from(key)).await {
                Ok(result) => result,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(RegistryError::store(context())(e)),
            };
            let mut stream = result.into_stream();
            let mut hasher = Sha256::new();
            let mut size = 0u64;
            while let Some(chunk) = stream
                .try_next()
                .await
                .map_err(RegistryError::store(context()))?
            {
                hasher.update(&chunk);
                size += chunk.len() as u64;
            }
            Ok(Some((size, hex::encode(hasher.finalize()))))
        })
    }

    /// The names of the folders directly under `key` (`bert4rec` -> `["1", "2"]`).
    pub fn folders(&self, key: &str) -> Result<Vec<String>> {
        let prefix = Path::from(key);
        let listing = self
            .runtime
            .block_on(self.store.list_with_delimiter(Some(&prefix)))
            .map_err(RegistryError::store(format!(
                "cannot list {}",
                self.describe(key)
            )))?;
        Ok(listing
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect())
    }

    /// Every object under `key`, as (path relative to `key`, size), sorted.
    pub fn files(&self, key: &str) -> Result<Vec<(String, u64)>> {
        let prefix = Path::from(key);
        let objects: Vec<_> = self
            .runtime
            .block_on(self.store.list(Some(&prefix)).try_collect())
            .map_err(RegistryError::store(format!(
                "cannot list {}",
                self.describe(key)
            )))?;
        let mut out: Vec<(String, u64)> = objects
            .into_iter()
            .filter_map(|meta| {
                let relative: Vec<String> = meta
                    .location
                    .prefix_match(&prefix)?
                    .map(|part| part.as_ref().to_string())
                    .collect();
                Some((relative.join("/"), meta.size))
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// Removes the folder `key` once it holds nothing: a local directory keeps empty folders,
    /// which would still list as a (recordless, incomplete) version; object stores have no
    /// folders to remove.
    pub fn remove_empty_folder(&self, key: &str) -> Result<()> {
        if let Location::Local(dir) = &self.location {
            let path = dir.join(key);
            if path.is_dir() {
                let _ = std::fs::remove_dir(&path);
            }
        }
        Ok(())
    }

    /// Removes the object at `key` (absent is fine).
    pub fn delete(&self, key: &str) -> Result<()> {
        self.fenced(key)?;
        faults::before_write(key);
        match self.runtime.block_on(self.store.delete(&Path::from(key))) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                faults::after_write(key);
                Ok(())
            }
            Err(e) => Err(RegistryError::store(format!(
                "cannot delete {}",
                self.describe(key)
            ))(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn both() -> Vec<(tempfile::TempDir, Repository)> {
        let dir = tempfile::tempdir().unwrap();
        let local = Repository::open(dir.path().join("repo").to_str().unwrap()).unwrap();
        vec![
            (dir, local),
            (tempfile::tempdir().unwrap(), Repository::in_memory()),
        ]
    }

    #[test]
    fn create_refuses_an_existing_object_and_replace_detects_a_change() {
        for (_dir, repo) in both() {
            assert!(repo.create("m/1/record", b"a").unwrap());
            assert!(!repo.create("m/1/record", b"b").unwrap());
            let first = repo.read("m/1/record").unwrap().unwrap();
            assert_eq!(first.bytes, b"a");
            assert!(repo.replace("m/1/record", b"c", &first).unwrap());
            if repo.uri() == "memory://" {
                // The store with conditional replace refuses a stale expectation.
                assert!(!repo.replace("m/1/record", b"d", &first).unwrap());
            }
            assert_eq!(repo.read("m/1/record").unwrap().unwrap().bytes, b"c");
            assert!(repo.read("m/2/record").unwrap().is_none());
        }
    }

    #[test]
    fn uploads_of_any_size_arrive_whole_and_list_as_folders_and_files() {
        for (dir, repo) in both() {
            let big = dir.path().join("big.bin");
            let data: Vec<u8> = (0..(PART_BYTES * 2 + 12345))
                .map(|i| (i % 251) as u8)
                .collect();
            std::fs::write(&big, &data).unwrap();
            let small = dir.path().join("small.txt");
            std::fs::write(&small, b"hello").unwrap();
            let mut seen = Vec::new();
            assert_eq!(
                repo.upload("m/3/big.bin", &big, &mut |n| seen.push(n))
                    .unwrap(),
                data.len() as u64
            );
            assert_eq!(*seen.last().unwrap(), data.len() as u64);
            repo.upload("m/3/small.txt", &small, &mut |_| {}).unwrap();
            repo.overwrite("m/config.pbtxt", b"x").unwrap();
            repo.create("m/10/record", b"r").unwrap();
            let mut folders = repo.folders("m").unwrap();
            folders.sort();
            assert_eq!(folders, ["10", "3"]);
            assert_eq!(
                repo.files("m/3").unwrap(),
                [
                    ("big.bin".to_string(), data.len() as u64),
                    ("small.txt".to_string(), 5)
                ]
            );
            let back = dir.path().join("back.bin");
            repo.download("m/3/big.bin", &back).unwrap();
            assert_eq!(std::fs::read(&back).unwrap(), data);
            repo.delete("m/3/small.txt").unwrap();
            repo.delete("m/3/small.txt").unwrap();
            assert_eq!(repo.files("m/3").unwrap().len(), 1);
        }
    }
}
