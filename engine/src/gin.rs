//! The bindings of a gin config file (the format Meta's generative-recommenders trains HSTU
//! with), read as data: `scope.name = value` lines whose values are numbers, strings, booleans,
//! `None`, `@references` or lists of those. Nothing is imported or called; a file that asks for
//! that (`import`, `include`) is read for its own bindings only, and says so in the error when
//! one it needs is missing. Each binding is keyed by its name without the scope
//! (`train_fn.max_sequence_length` gives `max_sequence_length`), the names the model configs read.

use serde_json::{Map, Number, Value};

/// The bindings of gin config `text`, by name without scope (a later binding of a name wins, as
/// in gin). Errors name the line.
pub fn bindings(text: &str) -> Result<Map<String, Value>, String> {
    let mut out = Map::new();
    let mut lines = text.lines().enumerate().peekable();
    while let Some((n, line)) = lines.next() {
        let mut statement = strip_comment(line).trim().to_string();
        if statement.is_empty()
            || statement.starts_with("import ")
            || statement.starts_with("from ")
            || statement.starts_with("include ")
        {
            continue;
        }
        // A value may go on over lines while a bracket is open or a line ends in `\`.
        while open_brackets(&statement) > 0 || statement.ends_with('\\') {
            let Some((_, more)) = lines.next() else {
                return Err(format!(
                    "line {}: the value of {statement:?} is not closed",
                    n + 1
                ));
            };
            statement = statement.trim_end_matches('\\').to_string();
            statement.push(' ');
            statement.push_str(strip_comment(more).trim());
        }
        let Some((key, value)) = statement.split_once('=') else {
            return Err(format!(
                "line {}: {statement:?} is not a binding (scope.name = value)",
                n + 1
            ));
        };
        let key = key.trim();
        let name = key.rsplit(['.', '/']).next().unwrap_or(key).trim();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("line {}: {key:?} is not a binding's name", n + 1));
        }
        let value =
            parse_value(value.trim()).map_err(|e| format!("line {} ({key}): {e}", n + 1))?;
        out.insert(name.to_string(), value);
    }
    Ok(out)
}

/// The line up to a `#` that is not inside a string.
fn strip_comment(line: &str) -> &str {
    let mut quote = None;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '#') => return &line[..i],
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            _ => {}
        }
    }
    line
}

/// Brackets opened and not closed in `text` (outside strings).
fn open_brackets(text: &str) -> i32 {
    let mut quote = None;
    let mut depth = 0;
    for c in text.chars() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '[' | '(' | '{') => depth += 1,
            (None, ']' | ')' | '}') => depth -= 1,
            _ => {}
        }
    }
    depth
}

fn parse_value(text: &str) -> Result<Value, String> {
    match text {
        "True" | "true" => return Ok(Value::Bool(true)),
        "False" | "false" => return Ok(Value::Bool(false)),
        "None" => return Ok(Value::Null),
        _ => {}
    }
    if let Some(inner) = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .or_else(|| text.strip_prefix('\'').and_then(|t| t.strip_suffix('\'')))
    {
        return Ok(Value::String(inner.to_string()));
    }
    if text.starts_with('@') || text.starts_with('%') {
        // A reference to a configurable or a macro: kept by name.
        return Ok(Value::String(text.to_string()));
    }
    if let Some(inner) = text
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .or_else(|| text.strip_prefix('(').and_then(|t| t.strip_suffix(')')))
    {
        return split_items(inner)
            .into_iter()
            .filter(|item| !item.trim().is_empty())
            .map(|item| parse_value(item.trim()))
            .collect::<Result<Vec<_>, _>>()
            .map(Value::Array);
    }
    let plain = text.replace('_', "");
    if let Ok(i) = plain.parse::<i64>() {
        return Ok(Value::Number(i.into()));
    }
    if let Ok(f) = plain.parse::<f64>() {
        return Number::from_f64(f)
            .map(Value::Number)
            .ok_or_else(|| format!("{text} is not a finite number"));
    }
    Err(format!(
        "{text:?} is not a value recsys reads (a number, a quoted string, True/False/None, an \
         @reference or a list of those)"
    ))
}

/// A list's items, split at top-level commas.
fn split_items(inner: &str) -> Vec<&str> {
    let (mut items, mut start, mut depth, mut quote) = (Vec::new(), 0, 0, None);
    for (i, c) in inner.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '[' | '(') => depth += 1,
            (None, ']' | ')') => depth -= 1,
            (None, ',') if depth == 0 => {
                items.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_official_style_config_gives_its_bindings_by_name() {
        let text = r#"
# Frozen config.
train_fn.dataset_name = "ml-1m"
train_fn.max_sequence_length = 200  # the window
train_fn.main_module = "HSTU"
train_fn.item_l2_norm = True
train_fn.temperature = 0.05
train_fn.learning_rate = 1e-3
train_fn.top_k_method = "MIPSBruteForceTopK"
hstu_encoder.num_blocks = 2
hstu_encoder.concat_ua = False
hstu_encoder.linear_activation = 'silu'
create_model.eval_ks = [1, 10,
    50, 200]
get_reco_dataset.positional_sampling_ratio = 1_000
some_fn.reference = @other_fn
"#;
        let b = bindings(text).unwrap();
        assert_eq!(b["dataset_name"], "ml-1m");
        assert_eq!(b["max_sequence_length"], 200);
        assert_eq!(b["main_module"], "HSTU");
        assert_eq!(b["item_l2_norm"], true);
        assert_eq!(b["concat_ua"], false);
        assert_eq!(b["temperature"], 0.05);
        assert_eq!(b["learning_rate"], 1e-3);
        assert_eq!(b["num_blocks"], 2);
        assert_eq!(b["linear_activation"], "silu");
        assert_eq!(b["eval_ks"], serde_json::json!([1, 10, 50, 200]));
        assert_eq!(b["positional_sampling_ratio"], 1000);
        assert_eq!(b["reference"], "@other_fn");
    }

    #[test]
    fn lines_that_are_not_bindings_are_named() {
        let err = bindings("train_fn.x = 1\nthis is not gin\n").unwrap_err();
        assert!(err.starts_with("line 2:"), "{err}");
        let err = bindings("a.b = [1, 2\n").unwrap_err();
        assert!(err.contains("not closed"), "{err}");
        let err = bindings("a.b = lambda: 3\n").unwrap_err();
        assert!(err.contains("line 1 (a.b)"), "{err}");
    }
}
