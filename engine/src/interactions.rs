//! Interaction logs (RecBole's atomic `.inter` files, or any CSV/TSV with a header) read as each
//! user's events in time order: what fold-in ([`crate::fold_in`]) learns new items from.

use std::collections::HashMap;
use std::path::Path;

/// Header names of the user column, tried in order (case-insensitive).
const USER_COLUMNS: [&str; 4] = ["user_id:token", "user_id", "user", "userid"];
/// Header names of the item column.
const ITEM_COLUMNS: [&str; 4] = ["item_id:token", "item_id", "item", "itemid"];
/// Header names of the time column (optional: without one, the file's order is the time order).
const TIME_COLUMNS: [&str; 5] = [
    "timestamp:float",
    "timestamp:token",
    "timestamp",
    "time",
    "ts",
];

/// One user's events, oldest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UserLog {
    pub user: String,
    /// External item ids as the log spells them.
    pub items: Vec<String>,
    /// Unix seconds per event (empty when the log has no time column).
    pub times: Vec<i64>,
}

/// Reads the log at `path` (CSV by a `.csv` extension, else tab-separated, with a header): users
/// in order of first appearance, each user's events sorted by time (stable: ties keep the file's
/// order).
pub fn read_user_logs(path: &Path) -> Result<Vec<UserLog>, String> {
    let mut reader = crate::item_sets::delimited_reader(path)?;
    let header = reader
        .headers()
        .map_err(|e| format!("{}: {e}", path.display()))?
        .clone();
    let names: Vec<&str> = header.iter().collect();
    let find = |candidates: &[&str]| {
        candidates
            .iter()
            .find_map(|c| names.iter().position(|n| n.eq_ignore_ascii_case(c)))
    };
    let missing = |what: &str, candidates: &[&str]| {
        format!(
            "{}: no {what} column in the header ({}); expected one of {}",
            path.display(),
            names.join(", "),
            candidates.join(" / ")
        )
    };
    let user_at = find(&USER_COLUMNS).ok_or_else(|| missing("user", &USER_COLUMNS))?;
    let item_at = find(&ITEM_COLUMNS).ok_or_else(|| missing("item", &ITEM_COLUMNS))?;
    let time_at = find(&TIME_COLUMNS);

    let mut logs: Vec<UserLog> = Vec::new();
    let mut by_user: HashMap<String, usize> = HashMap::new();
    let mut record = csv::StringRecord::new();
    let mut line = 1u64;
    loop {
        line += 1;
        match reader.read_record(&mut record) {
            Ok(false) => break,
            Ok(true) => {}
            Err(e) => return Err(format!("{} line {line}: {e}", path.display())),
        }
        let field = |at: usize, what: &str| {
            record.get(at).map(str::trim).ok_or_else(|| {
                format!(
                    "{} line {line}: {} field(s), the {what} column is field {}",
                    path.display(),
                    record.len(),
                    at + 1
                )
            })
        };
        let user = field(user_at, "user")?;
        let item = field(item_at, "item")?;
        if item.is_empty() {
            return Err(format!("{} line {line}: an empty item id", path.display()));
        }
        let time = match time_at {
            None => None,
            Some(at) => {
                let text = field(at, "time")?;
                // RecBole writes timestamps as floats; a fraction of a second changes no order
                // that matters here.
                let value: f64 = text.parse().map_err(|_| {
                    format!(
                        "{} line {line}: time {text:?} is not a number (unix seconds)",
                        path.display()
                    )
                })?;
                if !value.is_finite() {
                    return Err(format!(
                        "{} line {line}: time {text:?} is not finite",
                        path.display()
                    ));
                }
                Some(value as i64)
            }
        };
        let at = *by_user.entry(user.to_string()).or_insert_with(|| {
            logs.push(UserLog {
                user: user.to_string(),
                ..Default::default()
            });
            logs.len() - 1
        });
        let log = &mut logs[at];
        log.items.push(item.to_string());
        if let Some(time) = time {
            log.times.push(time);
        }
    }
    if logs.is_empty() {
        return Err(format!("{}: no interactions", path.display()));
    }
    for log in &mut logs {
        if !log.times.is_empty() {
            let mut order: Vec<usize> = (0..log.items.len()).collect();
            order.sort_by_key(|&i| log.times[i]);
            log.items = order.iter().map(|&i| log.items[i].clone()).collect();
            log.times = order.iter().map(|&i| log.times[i]).collect();
        }
    }
    Ok(logs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_keep_their_order_and_events_are_sorted_by_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.inter");
        std::fs::write(
            &path,
            "user_id:token\titem_id:token\ttimestamp:float\n\
             u2\t7\t30.0\nu1\t5\t20\nu2\t8\t10\nu1\t6\t20\n",
        )
        .unwrap();
        let logs = read_user_logs(&path).unwrap();
        assert_eq!(logs.len(), 2);
        assert_eq!(
            (logs[0].user.as_str(), &logs[0].items[..]),
            ("u2", &["8".to_string(), "7".to_string()][..])
        );
        assert_eq!(logs[0].times, [10, 30]);
        assert_eq!(logs[1].items, ["5", "6"], "ties keep the file's order");

        std::fs::write(&path, "user_id\titem\n1\t9\n").unwrap();
        assert_eq!(read_user_logs(&path).unwrap()[0].times, Vec::<i64>::new());
        std::fs::write(&path, "who\titem_id\n1\t9\n").unwrap();
        let e = read_user_logs(&path).unwrap_err();
        assert!(
            e.contains("no user column") && e.contains("who, item_id"),
            "{e}"
        );
        std::fs::write(&path, "user_id\titem_id\ttimestamp\n1\t9\tsoon\n").unwrap();
        let e = read_user_logs(&path).unwrap_err();
        assert!(e.contains("line 2") && e.contains("\"soon\""), "{e}");
    }
}
