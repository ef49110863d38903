//! docs/ARCHITECTURE.md describes the code as it is: every module file a crate declares at its
//! root (`mod x;` in lib.rs or main.rs) is named in that crate's section of the document, so a
//! module added without a word on its job fails here.

use std::path::Path;

/// The `## <crate> (`<dir>/...`)` section of the document for `dir`, up to the next `## `.
fn section<'a>(doc: &'a str, dir: &str) -> &'a str {
    let marker = format!("(`{dir}/");
    let start = doc
        .match_indices("\n## ")
        .map(|(i, _)| i + 1)
        .find(|&i| doc[i..].lines().next().is_some_and(|l| l.contains(&marker)))
        .unwrap_or_else(|| panic!("docs/ARCHITECTURE.md has no section for {dir}/"));
    let end = doc[start + 3..]
        .find("\n## ")
        .map_or(doc.len(), |i| start + 3 + i);
    &doc[start..end]
}

/// The file modules declared at a crate root (`mod x;`, not inline `mod x { ... }`).
fn file_modules(root: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root).unwrap();
    text.lines()
        .map(str::trim)
        .filter_map(|l| {
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
            l.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn every_crate_root_module_is_described_in_its_section() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(repo.join("docs/ARCHITECTURE.md")).unwrap();
    let mut checked = 0;
    for (dir, roots) in [
        ("kernels", &["src/lib.rs"][..]),
        ("engine", &["src/lib.rs"][..]),
        ("cli", &["src/lib.rs", "src/main.rs"][..]),
        ("backend", &["src/lib.rs"][..]),
        ("registry", &["src/lib.rs"][..]),
        ("onnx", &["src/lib.rs"][..]),
        ("gpu", &["src/lib.rs"][..]),
        ("python", &["src/lib.rs"][..]),
    ] {
        let text = section(&doc, dir);
        for root in roots {
            for module in file_modules(&repo.join(dir).join(root)) {
                let named = [
                    format!("`{module}`"),
                    format!("`{module}.rs`"),
                    format!("`{module}/"),
                    format!("/{module}.rs`"),
                    format!("`{module}` ("),
                ]
                .iter()
                .any(|form| text.contains(form.as_str()));
                assert!(
                    named,
                    "{dir}/{root} declares `mod {module};`, which docs/ARCHITECTURE.md's {dir} \
                     section does not name"
                );
                checked += 1;
            }
        }
    }
    assert!(
        checked > 40,
        "only {checked} modules found: the roots moved?"
    );
}
