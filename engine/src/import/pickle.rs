//! A pickle reader that treats the stream as data.
//!
//! PyTorch checkpoints are pickles, and unpickling normally imports modules and calls whatever the
//! stream names. This reader never does: `GLOBAL` yields an inert [`Value::Global`] and `REDUCE`,
//! `NEWOBJ` and `BUILD` record the call as a [`Value::Object`] for the caller to interpret (or skip).
//! The only constructor it evaluates is `collections.OrderedDict()`, which is plain data.
//!
//! Hostile input is expected: every length is checked against the bytes left, and the number of
//! values produced (including memo copies) is bounded, so a small file cannot claim unbounded memory.

use std::collections::HashMap;

/// A decoded pickle value. Containers own their elements.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer too large for i64, kept as little-endian two's complement bytes.
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    Set(Vec<Value>),
    /// A reference to `module.name`; never resolved.
    Global {
        module: String,
        name: String,
    },
    /// The result of calling `callable(*args)` and then `BUILD`ing `state` into it, recorded, not run.
    Object {
        callable: Box<Value>,
        args: Box<Value>,
        state: Option<Box<Value>>,
        /// Items set on the object by `SETITEM(S)` (dict subclasses) or `APPEND(S)` (list subclasses).
        dict_items: Vec<(Value, Value)>,
        list_items: Vec<Value>,
    },
    /// A persistent id (`BINPERSID`); PyTorch uses it to point at tensor storages.
    PersistentId(Box<Value>),
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }

    /// Elements of a tuple or list.
    pub fn as_sequence(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    /// Key/value pairs of a dict, or of a dict-like object (an `OrderedDict` subclass).
    pub fn as_dict(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(items) => Some(items),
            Value::Object { dict_items, .. } if !dict_items.is_empty() => Some(dict_items),
            _ => None,
        }
    }

    /// Looks up a string key in a dict.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.as_dict()?
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v)
    }

    pub fn is_global(&self, module: &str, name: &str) -> bool {
        matches!(self, Value::Global { module: m, name: n } if m == module && n == name)
    }

    /// How many values this one contains, itself included; used to bound memory.
    fn node_count(&self) -> usize {
        1 + match self {
            Value::List(v) | Value::Tuple(v) | Value::Set(v) => {
                v.iter().map(Value::node_count).sum()
            }
            Value::Dict(items) => items
                .iter()
                .map(|(k, v)| k.node_count() + v.node_count())
                .sum(),
            Value::Object {
                callable,
                args,
                state,
                dict_items,
                list_items,
            } => {
                callable.node_count()
                    + args.node_count()
                    + state.as_ref().map_or(0, |s| s.node_count())
                    + dict_items
                        .iter()
                        .map(|(k, v)| k.node_count() + v.node_count())
                        .sum::<usize>()
                    + list_items.iter().map(Value::node_count).sum::<usize>()
            }
            Value::PersistentId(v) => v.node_count(),
            _ => 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("pickle error at byte {offset}: {message}")]
pub struct PickleError {
    pub offset: usize,
    pub message: String,
}

/// Upper bound on values created while decoding, memo copies included. Real checkpoints stay far
/// below it (a RecBole checkpoint produces a few thousand); a hostile stream hits it quickly.
const MAX_VALUES: usize = 10_000_000;
const MAX_STACK_DEPTH: usize = 100_000;

enum Slot {
    Value(Value, Option<u32>),
    Mark,
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Slot>,
    memo: HashMap<u32, Value>,
    values_made: usize,
}

/// Decodes a whole pickle stream and returns the value that `STOP` leaves on the stack.
pub fn parse(data: &[u8]) -> Result<Value, PickleError> {
    let mut machine = Machine {
        data,
        pos: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
        values_made: 0,
    };
    machine.run()
}

impl<'a> Machine<'a> {
    fn error<T>(&self, message: impl Into<String>) -> Result<T, PickleError> {
        Err(PickleError {
            offset: self.pos,
            message: message.into(),
        })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        if n > self.data.len() - self.pos {
            return self.error(format!(
                "truncated: needs {n} bytes, {} left",
                self.data.len() - self.pos
            ));
        }
        let bytes = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, PickleError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, PickleError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64_len(&mut self) -> Result<usize, PickleError> {
        let b = self.take(8)?;
        let n = u64::from_le_bytes(b.try_into().expect("8 bytes"));
        usize::try_from(n).or_else(|_| self.error("length does not fit in memory"))
    }

    /// Reads a text line (protocol 0 arguments), without the newline.
    fn line(&mut self) -> Result<&'a str, PickleError> {
        let rest = &self.data[self.pos..];
        let Some(end) = rest.iter().position(|&b| b == b'\n') else {
            return self.error("truncated: unterminated text argument");
        };
        self.pos += end + 1;
        std::str::from_utf8(&rest[..end]).or_else(|_| self.error("text argument is not UTF-8"))
    }

    fn utf8(&mut self, n: usize) -> Result<Value, PickleError> {
        let bytes = self.take(n)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Value::Str(s.to_owned())),
            Err(_) => self.error("string is not valid UTF-8"),
        }
    }

    fn count(&mut self, n: usize) -> Result<(), PickleError> {
        self.values_made = self.values_made.saturating_add(n);
        if self.values_made > MAX_VALUES {
            return self.error(format!(
                "more than {MAX_VALUES} values; refusing to continue"
            ));
        }
        Ok(())
    }

    fn push(&mut self, value: Value) -> Result<(), PickleError> {
        if self.stack.len() >= MAX_STACK_DEPTH {
            return self.error("stack too deep");
        }
        self.count(1)?;
        self.stack.push(Slot::Value(value, None));
        Ok(())
    }

    fn pop(&mut self) -> Result<Value, PickleError> {
        match self.stack.pop() {
            Some(Slot::Value(v, _)) => Ok(v),
            Some(Slot::Mark) => self.error("unexpected mark on the stack"),
            None => self.error("stack underflow"),
        }
    }

    /// Pops everything above the topmost mark, and the mark.
    fn pop_to_mark(&mut self) -> Result<Vec<Value>, PickleError> {
        let Some(mark) = self.stack.iter().rposition(|s| matches!(s, Slot::Mark)) else {
            return self.error("no mark on the stack");
        };
        let items = self
            .stack
            .drain(mark + 1..)
            .map(|slot| match slot {
                Slot::Value(v, _) => v,
                Slot::Mark => unreachable!("rposition found the topmost mark"),
            })
            .collect();
        self.stack.pop();
        Ok(items)
    }

    fn memo_put(&mut self, index: u32) -> Result<(), PickleError> {
        let Some(Slot::Value(top, link)) = self.stack.last_mut() else {
            return self.error("memo put with an empty stack");
        };
        *link = Some(index);
        let copy = top.clone();
        self.memo.insert(index, copy);
        Ok(())
    }

    fn memo_get(&mut self, index: u32) -> Result<(), PickleError> {
        let Some(value) = self.memo.get(&index) else {
            return self.error(format!("memo key {index} was never stored"));
        };
        let value = value.clone();
        // A copy costs as much memory as the original: count every node so that repeated gets of a
        // growing container cannot blow up.
        self.count(value.node_count())?;
        if self.stack.len() >= MAX_STACK_DEPTH {
            return self.error("stack too deep");
        }
        self.stack.push(Slot::Value(value, Some(index)));
        Ok(())
    }

    /// Applies `mutate` to the value on top of the stack and to its memo copy, so that later memo
    /// gets see the populated container (pickle memoizes containers before filling them).
    fn mutate_top(
        &mut self,
        mutate: impl Fn(&mut Value) -> Result<(), String>,
    ) -> Result<(), PickleError> {
        let offset = self.pos;
        let Some(Slot::Value(top, link)) = self.stack.last_mut() else {
            return self.error("no container on the stack");
        };
        mutate(top).map_err(|message| PickleError { offset, message })?;
        if let Some(index) = *link {
            if let Some(memoized) = self.memo.get_mut(&index) {
                mutate(memoized).map_err(|message| PickleError { offset, message })?;
            }
        }
        Ok(())
    }

    fn run(&mut self) -> Result<Value, PickleError> {
        loop {
            let op = self.u8()?;
            match op {
                0x80 => {
                    // PROTO
                    let version = self.u8()?;
                    if version > 5 {
                        return self.error(format!("unsupported pickle protocol {version}"));
                    }
                }
                0x95 => {
                    // FRAME: a length prefix for buffering; the content follows inline.
                    self.take(8)?;
                }
                b'.' => return self.pop(),
                b'(' => self.stack.push(Slot::Mark),
                b'0' => {
                    self.stack.pop();
                }
                b'1' => {
                    self.pop_to_mark()?;
                }
                b'2' => {
                    let top = match self.stack.last() {
                        Some(Slot::Value(v, _)) => v.clone(),
                        _ => return self.error("DUP of a non-value"),
                    };
                    self.count(top.node_count())?;
                    self.push(top)?;
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'J' => {
                    let b = self.take(4)?;
                    let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    self.push(Value::Int(v as i64))?
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(v as i64))?
                }
                b'M' => {
                    let v = self.u16()?;
                    self.push(Value::Int(v as i64))?
                }
                0x8a | 0x8b => {
                    // LONG1 / LONG4: little-endian two's complement of the given length.
                    let n = if op == 0x8a {
                        self.u8()? as usize
                    } else {
                        self.u32()? as usize
                    };
                    let bytes = self.take(n)?;
                    self.push(long_from_bytes(bytes))?
                }
                b'I' | b'L' => {
                    let text = self.line()?.trim_end_matches('L');
                    let value = match text {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        _ => match text.parse::<i64>() {
                            Ok(v) => Value::Int(v),
                            Err(_) => return self.error(format!("bad integer literal {text:?}")),
                        },
                    };
                    self.push(value)?
                }
                b'G' => {
                    let b = self.take(8)?;
                    self.push(Value::Float(f64::from_be_bytes(b.try_into().expect("8"))))?
                }
                b'F' => {
                    let text = self.line()?;
                    match text.parse::<f64>() {
                        Ok(v) => self.push(Value::Float(v))?,
                        Err(_) => return self.error(format!("bad float literal {text:?}")),
                    }
                }
                b'X' => {
                    let n = self.u32()? as usize;
                    let s = self.utf8(n)?;
                    self.push(s)?
                }
                0x8c => {
                    let n = self.u8()? as usize;
                    let s = self.utf8(n)?;
                    self.push(s)?
                }
                0x8d => {
                    let n = self.u64_len()?;
                    let s = self.utf8(n)?;
                    self.push(s)?
                }
                b'V' => {
                    // Protocol 0 unicode uses raw-unicode-escape; checkpoints do not use it for
                    // anything but ASCII names, which pass through unchanged.
                    let text = self.line()?.to_owned();
                    self.push(Value::Str(text))?
                }
                b'B' | b'T' => {
                    let n = self.u32()? as usize;
                    let bytes = self.take(n)?.to_vec();
                    self.push(Value::Bytes(bytes))?
                }
                b'C' | b'U' => {
                    let n = self.u8()? as usize;
                    let bytes = self.take(n)?.to_vec();
                    self.push(Value::Bytes(bytes))?
                }
                0x8e | 0x96 => {
                    let n = self.u64_len()?;
                    let bytes = self.take(n)?.to_vec();
                    self.push(Value::Bytes(bytes))?
                }
                b'S' => {
                    let text = self.line()?;
                    let inner = text
                        .strip_prefix(['\'', '"'])
                        .and_then(|t| t.strip_suffix(['\'', '"']))
                        .unwrap_or(text);
                    self.push(Value::Str(inner.to_owned()))?
                }
                b']' => self.push(Value::List(Vec::new()))?,
                b')' => self.push(Value::Tuple(Vec::new()))?,
                b'}' => self.push(Value::Dict(Vec::new()))?,
                0x8f => self.push(Value::Set(Vec::new()))?,
                b'l' => {
                    let items = self.pop_to_mark()?;
                    self.push(Value::List(items))?
                }
                b't' => {
                    let items = self.pop_to_mark()?;
                    self.push(Value::Tuple(items))?
                }
                0x91 => {
                    let items = self.pop_to_mark()?;
                    self.push(Value::Set(items))?
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Value::Tuple(items))?
                }
                b'd' => {
                    let items = self.pop_to_mark()?;
                    let pairs = pairs_of(items).or_else(|m| self.error(m))?;
                    self.push(Value::Dict(pairs))?
                }
                b'a' => {
                    let item = self.pop()?;
                    self.mutate_top(|top| append(top, vec![item.clone()]))?
                }
                b'e' => {
                    let items = self.pop_to_mark()?;
                    self.mutate_top(|top| append(top, items.clone()))?
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    self.mutate_top(|top| set_items(top, vec![(key.clone(), value.clone())]))?
                }
                b'u' => {
                    let items = self.pop_to_mark()?;
                    let pairs = pairs_of(items).or_else(|m| self.error(m))?;
                    self.mutate_top(|top| set_items(top, pairs.clone()))?
                }
                0x90 => {
                    let items = self.pop_to_mark()?;
                    self.mutate_top(|top| match top {
                        Value::Set(set) => {
                            set.extend(items.iter().cloned());
                            Ok(())
                        }
                        _ => Err("ADDITEMS on a non-set".into()),
                    })?
                }
                b'c' => {
                    let module = self.line()?.to_owned();
                    let name = self.line()?.to_owned();
                    self.push(Value::Global { module, name })?
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Value::Str(module), Value::Str(name)) => {
                            self.push(Value::Global { module, name })?
                        }
                        _ => return self.error("STACK_GLOBAL needs two strings"),
                    }
                }
                b'R' | 0x81 => {
                    // REDUCE callable(*args) / NEWOBJ cls.__new__(cls, *args): recorded, never run.
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let value = construct(callable, args);
                    self.push(value)?
                }
                0x92 => {
                    // NEWOBJ_EX cls, args, kwargs
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.push(construct(callable, args))?
                }
                b'b' => {
                    let state = self.pop()?;
                    self.mutate_top(|top| match top {
                        Value::Object { state: slot, .. } => {
                            *slot = Some(Box::new(state.clone()));
                            Ok(())
                        }
                        // BUILD on a plain dict (an OrderedDict that we made data) updates it.
                        Value::Dict(items) => match &state {
                            Value::Dict(extra) => {
                                items.extend(extra.iter().cloned());
                                Ok(())
                            }
                            _ => Ok(()),
                        },
                        _ => Err("BUILD on a value that is not an object".into()),
                    })?
                }
                b'p' => {
                    let text = self.line()?;
                    let index = text
                        .parse::<u32>()
                        .or_else(|_| self.error(format!("bad memo index {text:?}")))?;
                    self.memo_put(index)?
                }
                b'q' => {
                    let index = self.u8()? as u32;
                    self.memo_put(index)?
                }
                b'r' => {
                    let index = self.u32()?;
                    self.memo_put(index)?
                }
                0x94 => {
                    let index = self.memo.len() as u32;
                    self.memo_put(index)?
                }
                b'g' => {
                    let text = self.line()?;
                    let index = text
                        .parse::<u32>()
                        .or_else(|_| self.error(format!("bad memo index {text:?}")))?;
                    self.memo_get(index)?
                }
                b'h' => {
                    let index = self.u8()? as u32;
                    self.memo_get(index)?
                }
                b'j' => {
                    let index = self.u32()?;
                    self.memo_get(index)?
                }
                b'Q' => {
                    let pid = self.pop()?;
                    self.push(Value::PersistentId(Box::new(pid)))?
                }
                b'P' => {
                    let text = self.line()?.to_owned();
                    self.push(Value::PersistentId(Box::new(Value::Str(text))))?
                }
                other => {
                    self.pos -= 1;
                    return self.error(format!("unsupported pickle opcode 0x{other:02x}"));
                }
            }
        }
    }
}

fn long_from_bytes(bytes: &[u8]) -> Value {
    if bytes.is_empty() {
        return Value::Int(0);
    }
    if bytes.len() <= 8 {
        let negative = bytes[bytes.len() - 1] & 0x80 != 0;
        let mut buf = if negative { [0xffu8; 8] } else { [0u8; 8] };
        buf[..bytes.len()].copy_from_slice(bytes);
        Value::Int(i64::from_le_bytes(buf))
    } else {
        Value::BigInt(bytes.to_vec())
    }
}

fn pairs_of(items: Vec<Value>) -> Result<Vec<(Value, Value)>, String> {
    if !items.len().is_multiple_of(2) {
        return Err("odd number of items for a dict".into());
    }
    let mut pairs = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        pairs.push((k, v));
    }
    Ok(pairs)
}

fn append(top: &mut Value, items: Vec<Value>) -> Result<(), String> {
    match top {
        Value::List(list) => list.extend(items),
        Value::Object { list_items, .. } => list_items.extend(items),
        _ => return Err("APPEND on a value that is not a list".into()),
    }
    Ok(())
}

fn set_items(top: &mut Value, pairs: Vec<(Value, Value)>) -> Result<(), String> {
    match top {
        Value::Dict(items) => items.extend(pairs),
        Value::Object { dict_items, .. } => dict_items.extend(pairs),
        _ => return Err("SETITEM on a value that is not a dict".into()),
    }
    Ok(())
}

/// Records a call. `collections.OrderedDict()` is the one constructor that is plain data, so it
/// becomes a dict directly; everything else stays an inert object description.
fn construct(callable: Value, args: Value) -> Value {
    if callable.is_global("collections", "OrderedDict")
        && args.as_sequence().is_some_and(|a| a.is_empty())
    {
        return Value::Dict(Vec::new());
    }
    Value::Object {
        callable: Box::new(callable),
        args: Box::new(args),
        state: None,
        dict_items: Vec::new(),
        list_items: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_protocol2_dict_with_memo() {
        // pickle.dumps({'a': [1, 2], 'b': 'x'}, protocol=2)
        let data = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01K\x02eX\x01\x00\x00\x00bq\x03X\x01\x00\x00\x00xq\x04u.";
        let v = parse(data).unwrap();
        assert_eq!(
            v.get("a"),
            Some(&Value::List(vec![Value::Int(1), Value::Int(2)]))
        );
        assert_eq!(v.get("b"), Some(&Value::Str("x".into())));
    }

    #[test]
    fn memo_get_sees_container_filled_after_put() {
        // A list memoized empty, filled, then fetched again from the memo.
        let data = b"\x80\x02]q\x00(K\x01K\x02e0h\x00.";
        assert_eq!(
            parse(data).unwrap(),
            Value::List(vec![Value::Int(1), Value::Int(2)])
        );
    }

    #[test]
    fn globals_and_reduce_are_recorded_not_run() {
        // pickle.dumps(os.system('echo pwned')) would be: c os\nsystem\n (X...tR.
        let data = b"cos\nsystem\n(X\x0a\x00\x00\x00echo pwnedtR.";
        let v = parse(data).unwrap();
        match v {
            Value::Object { callable, args, .. } => {
                assert!(callable.is_global("os", "system"));
                assert_eq!(*args, Value::Tuple(vec![Value::Str("echo pwned".into())]));
            }
            other => panic!("expected an inert object, got {other:?}"),
        }
    }

    #[test]
    fn truncated_stream_is_an_error() {
        let err = parse(b"\x80\x02X\xff\x00\x00\x00abc").unwrap_err();
        assert!(err.message.contains("truncated"), "{err}");
        assert!(parse(b"\x80\x02K\x01")
            .unwrap_err()
            .message
            .contains("truncated"));
    }

    #[test]
    fn memo_bomb_is_refused() {
        // Build a list, then repeatedly append a memo copy of itself: doubling each round.
        let mut data = b"\x80\x02]q\x00K\x01a".to_vec();
        for _ in 0..40 {
            data.extend_from_slice(b"h\x00a");
        }
        data.push(b'.');
        let err = parse(&data).unwrap_err();
        assert!(err.message.contains("refusing"), "{err}");
    }

    #[test]
    fn long1_decodes_negative_and_big_values() {
        assert_eq!(parse(b"\x8a\x01\xff.").unwrap(), Value::Int(-1));
        assert_eq!(
            parse(b"\x8a\x05\x00\x00\x00\x00\x01.").unwrap(),
            Value::Int(1 << 32)
        );
        assert!(matches!(
            parse(b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.").unwrap(),
            Value::BigInt(_)
        ));
    }
}
