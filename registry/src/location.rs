//! Where a model repository lives, in the syntax tritonserver's `--model-repository` takes, so one
//! string serves the CLI and the servers alike:
//! - `s3://bucket/path`: AWS S3 (region from the environment);
//! - `s3://[http://|https://]host:port/bucket/path`: an S3-compatible endpoint (MinIO, Ceph, ...),
//!   plain HTTP unless `https://` is given, path-style addressing (Triton's rules);
//! - `gs://bucket/path`: Google Cloud Storage;
//! - anything else: a local directory.

use std::path::PathBuf;

use crate::error::{RegistryError, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    Local(PathBuf),
    S3 {
        /// `http://host:port` or `https://host:port` for a custom endpoint; `None` for AWS.
        endpoint: Option<String>,
        bucket: String,
        /// The repository's folder inside the bucket, without leading or trailing slashes.
        prefix: String,
    },
    Gcs {
        bucket: String,
        prefix: String,
    },
}

fn syntax_error(text: &str, why: &str) -> RegistryError {
    RegistryError::Usage(format!(
        "{text:?} is not a repository location: {why} (expected a local directory, \
         s3://bucket/path, s3://[http://|https://]host:port/bucket/path or gs://bucket/path)"
    ))
}

/// Splits `bucket/path/...` into the bucket and the cleaned path (repeated slashes collapsed).
fn bucket_and_prefix(text: &str, rest: &str) -> Result<(String, String)> {
    let mut parts = rest.split('/').filter(|p| !p.is_empty());
    let bucket = parts
        .next()
        .ok_or_else(|| syntax_error(text, "no bucket"))?
        .to_string();
    // Triton's own pattern for bucket names; anything else it would not load either.
    if !bucket
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-')
    {
        return Err(syntax_error(
            text,
            &format!("bucket {bucket:?} may hold only lowercase letters, digits, '.' and '-'"),
        ));
    }
    let prefix: Vec<&str> = parts.collect();
    if let Some(bad) = prefix.iter().find(|p| {
        !p.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_')
    }) {
        return Err(syntax_error(
            text,
            &format!("path segment {bad:?} may hold only letters, digits, '.', '-' and '_'"),
        ));
    }
    Ok((bucket, prefix.join("/")))
}

impl Location {
    pub fn parse(text: &str) -> Result<Location> {
        if let Some(rest) = text.strip_prefix("s3://") {
            let (scheme, rest) = if let Some(r) = rest.strip_prefix("https://") {
                (Some("https"), r)
            } else if let Some(r) = rest.strip_prefix("http://") {
                (Some("http"), r)
            } else {
                (None, rest)
            };
            let first = rest.split('/').next().unwrap_or_default();
            let endpoint = match first.rsplit_once(':') {
                Some((host, port))
                    if !host.is_empty()
                        && !port.is_empty()
                        && port.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    Some(format!("{}://{host}:{port}", scheme.unwrap_or("http")))
                }
                _ if scheme.is_some() => {
                    return Err(syntax_error(
                        text,
                        "an endpoint needs its port (s3://http://host:port/bucket/path)",
                    ))
                }
                _ => None,
            };
            let rest = if endpoint.is_some() {
                &rest[first.len()..]
            } else {
                rest
            };
            let (bucket, prefix) = bucket_and_prefix(text, rest)?;
            return Ok(Location::S3 {
                endpoint,
                bucket,
                prefix,
            });
        }
        if let Some(rest) = text.strip_prefix("gs://") {
            let (bucket, prefix) = bucket_and_prefix(text, rest)?;
            return Ok(Location::Gcs { bucket, prefix });
        }
        if let Some((scheme, _)) = text.split_once("://") {
            return Err(syntax_error(text, &format!("{scheme}:// is not supported")));
        }
        if text.is_empty() {
            return Err(syntax_error(text, "empty"));
        }
        Ok(Location::Local(PathBuf::from(text)))
    }

    pub fn is_local(&self) -> bool {
        matches!(self, Location::Local(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s3(endpoint: Option<&str>, bucket: &str, prefix: &str) -> Location {
        Location::S3 {
            endpoint: endpoint.map(str::to_string),
            bucket: bucket.into(),
            prefix: prefix.into(),
        }
    }

    #[test]
    fn triton_syntax_is_understood() {
        let cases = [
            ("s3://models/repo", s3(None, "models", "repo")),
            ("s3://models", s3(None, "models", "")),
            ("s3://models//a/b/", s3(None, "models", "a/b")),
            (
                "s3://127.0.0.1:9000/models/repo",
                s3(Some("http://127.0.0.1:9000"), "models", "repo"),
            ),
            (
                "s3://http://minio.local:9000/models/repo",
                s3(Some("http://minio.local:9000"), "models", "repo"),
            ),
            (
                "s3://https://minio.local:443/models",
                s3(Some("https://minio.local:443"), "models", ""),
            ),
            (
                "gs://bucket-1/a/b",
                Location::Gcs {
                    bucket: "bucket-1".into(),
                    prefix: "a/b".into(),
                },
            ),
            (
                "model_repository",
                Location::Local("model_repository".into()),
            ),
            ("/srv/models", Location::Local("/srv/models".into())),
        ];
        for (text, want) in cases {
            assert_eq!(Location::parse(text).unwrap(), want, "{text}");
        }
    }

    #[test]
    fn malformed_locations_are_named() {
        for (text, why) in [
            ("s3://", "no bucket"),
            ("s3://Models/repo", "lowercase"),
            ("s3://http://minio/models", "port"),
            ("s3://models/a b", "path segment"),
            ("azure://x/y", "not supported"),
            ("", "empty"),
        ] {
            let err = Location::parse(text).unwrap_err().to_string();
            assert!(err.contains(why), "{text}: {err}");
        }
    }
}
