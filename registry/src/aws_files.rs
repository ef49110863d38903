//! AWS's shared configuration files (`~/.aws/credentials`, `~/.aws/config`), which the AWS CLI and
//! SDKs (Triton's among them) read when the environment holds no keys. object_store reads the
//! environment, web identity tokens and instance metadata, not these files, so the profile's keys
//! and region are read here and handed to it.
//!
//! Format: INI sections, `[name]` in the credentials file and `[profile name]` (or `[default]`) in
//! the config file, `key = value` lines, `#`/`;` comments. The profile is `AWS_PROFILE`, else
//! `default`; the paths are `AWS_SHARED_CREDENTIALS_FILE` and `AWS_CONFIG_FILE`, else under `~/.aws`.

use std::collections::HashMap;
use std::path::PathBuf;

/// Keys and region of the active profile, where the files name them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Profile {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    pub region: Option<String>,
}

/// The `key = value` pairs of section `section` of an INI text.
fn section(text: &str, wanted: &[String]) -> HashMap<String, String> {
    let mut inside = false;
    let mut out = HashMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = wanted.iter().any(|w| w == name.trim());
            continue;
        }
        if inside {
            if let Some((k, v)) = line.split_once('=') {
                out.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
    }
    out
}

fn home_file(env: &str, name: &str) -> Option<PathBuf> {
    std::env::var_os(env)
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".aws").join(name)))
}

/// Reads the active profile from the credentials and config texts.
pub fn profile_from(credentials: &str, config: &str, profile: &str) -> Profile {
    let creds = section(credentials, &[profile.to_string()]);
    let conf = section(config, &[format!("profile {profile}"), profile.to_string()]);
    let pick = |key: &str| creds.get(key).or_else(|| conf.get(key)).cloned();
    Profile {
        access_key_id: pick("aws_access_key_id"),
        secret_access_key: pick("aws_secret_access_key"),
        session_token: pick("aws_session_token"),
        region: conf.get("region").or_else(|| creds.get("region")).cloned(),
    }
}

/// The active profile from the files on this machine (missing files read as empty).
pub fn profile() -> Profile {
    let read = |path: Option<PathBuf>| {
        path.and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    };
    let name = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
    profile_from(
        &read(home_file("AWS_SHARED_CREDENTIALS_FILE", "credentials")),
        &read(home_file("AWS_CONFIG_FILE", "config")),
        &name,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_named_profile_wins_and_the_region_comes_from_config() {
        let credentials = "\
# comment
[default]
aws_access_key_id = AKIDEFAULT
aws_secret_access_key = secretdefault

[ci]
aws_access_key_id=AKICI
aws_secret_access_key=secretci
aws_session_token = token
";
        let config = "[default]\nregion = eu-west-1\n[profile ci]\nregion=us-west-2\n";
        assert_eq!(
            profile_from(credentials, config, "ci"),
            Profile {
                access_key_id: Some("AKICI".into()),
                secret_access_key: Some("secretci".into()),
                session_token: Some("token".into()),
                region: Some("us-west-2".into()),
            }
        );
        let default = profile_from(credentials, config, "default");
        assert_eq!(default.access_key_id.as_deref(), Some("AKIDEFAULT"));
        assert_eq!(default.region.as_deref(), Some("eu-west-1"));
        assert_eq!(profile_from("", "", "none"), Profile::default());
    }
}
