//! Interaction logs (RecBole's atomic `.inter` files, or any CSV/TSV with a header): the one reader
//! of their header and records ([`LogReader`]), and each user's events in time order, what fold-in
//! ([`crate::fold_in`]) learns new items from. The popularity counts read their logs through the
//! same reader.

use std::collections::HashMap;
use std::path::Path;

/// Header names of the user column, tried in order (case-insensitive).
const USER_COLUMNS: [&str; 4] = ["user_id:token", "user_id", "user", "userid"];
/// Header names of the item column: RecBole's atomic files, then the plain names.
pub(crate) const ITEM_COLUMNS: [&str; 4] = ["item_id:token", "item_id", "item", "itemid"];
/// Header names of the time column (optional: without one, the file's order is the time order).
const TIME_COLUMNS: [&str; 5] = [
    "timestamp:float",
    "timestamp:token",
    "timestamp",
    "time",
    "ts",
];

/// An interaction log opened for reading (CSV by a `.csv` extension, else tab-separated, with a
/// header), its records read one by one with their line numbers for messages: the reader of
/// fold-in's [`read_user_logs`] and of the popularity counts
/// ([`crate::popularity::Popularity::count_file`]).
pub(crate) struct LogReader<'p> {
    path: &'p Path,
    reader: csv::Reader<std::fs::File>,
    names: Vec<String>,
    record: csv::StringRecord,
    line: u64,
}

/// One record of a [`LogReader`].
pub(crate) struct LogRecord<'r> {
    path: &'r Path,
    record: &'r csv::StringRecord,
    line: u64,
}

impl<'p> LogReader<'p> {
    pub(crate) fn open(path: &'p Path) -> Result<Self, String> {
        let mut reader = crate::item_sets::delimited_reader(path)?;
        let names = reader
            .headers()
            .map_err(|e| format!("{}: {e}", path.display()))?
            .iter()
            .map(str::to_owned)
            .collect();
        Ok(LogReader {
            path,
            reader,
            names,
            record: csv::StringRecord::new(),
            line: 1,
        })
    }

    /// The header's column names.
    pub(crate) fn names(&self) -> &[String] {
        &self.names
    }

    /// The first of `candidates` the header has (case-insensitive), by position.
    pub(crate) fn find(&self, candidates: &[&str]) -> Option<usize> {
        candidates
            .iter()
            .find_map(|c| self.names.iter().position(|n| n.eq_ignore_ascii_case(c)))
    }

    /// The message of a header without the `what` column.
    pub(crate) fn missing(&self, what: &str, candidates: &[&str]) -> String {
        format!(
            "{}: no {what} column in the header ({}); expected one of {}",
            self.path.display(),
            self.names.join(", "),
            candidates.join(" / ")
        )
    }

    /// The next record, `None` at the end.
    pub(crate) fn next_record(&mut self) -> Result<Option<LogRecord<'_>>, String> {
        self.line += 1;
        match self.reader.read_record(&mut self.record) {
            Ok(false) => Ok(None),
            Ok(true) => Ok(Some(LogRecord {
                path: self.path,
                record: &self.record,
                line: self.line,
            })),
            Err(e) => Err(format!("{} line {}: {e}", self.path.display(), self.line)),
        }
    }
}

impl LogRecord<'_> {
    /// Field `at` (the `what` column), trimmed; a short record is an error naming its line.
    pub(crate) fn field(&self, at: usize, what: &str) -> Result<&str, String> {
        self.record.get(at).map(str::trim).ok_or_else(|| {
            format!(
                "{} line {}: {} field(s), the {what} column is field {}",
                self.path.display(),
                self.line,
                self.record.len(),
                at + 1
            )
        })
    }

    /// A message about this record.
    pub(crate) fn error(&self, message: impl std::fmt::Display) -> String {
        format!("{} line {}: {message}", self.path.display(), self.line)
    }
}

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
    let mut log_reader = LogReader::open(path)?;
    let user_at = log_reader
        .find(&USER_COLUMNS)
        .ok_or_else(|| log_reader.missing("user", &USER_COLUMNS))?;
    let item_at = log_reader
        .find(&ITEM_COLUMNS)
        .ok_or_else(|| log_reader.missing("item", &ITEM_COLUMNS))?;
    let time_at = log_reader.find(&TIME_COLUMNS);

    let mut logs: Vec<UserLog> = Vec::new();
    let mut by_user: HashMap<String, usize> = HashMap::new();
    while let Some(record) = log_reader.next_record()? {
        let user = record.field(user_at, "user")?;
        let item = record.field(item_at, "item")?;
        if item.is_empty() {
            return Err(record.error("an empty item id"));
        }
        let time = match time_at {
            None => None,
            Some(at) => {
                let text = record.field(at, "time")?;
                // RecBole writes timestamps as floats; a fraction of a second changes no order
                // that matters here.
                let value: f64 = text.parse().map_err(|_| {
                    record.error(format!("time {text:?} is not a number (unix seconds)"))
                })?;
                if !value.is_finite() {
                    return Err(record.error(format!("time {text:?} is not finite")));
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
