//! The tokens of protobuf's text format, with their byte ranges: enough to find what a
//! `config.pbtxt` declares at its top level and where, without a protobuf text parser. Comments
//! (`#` to the end of the line) and the insides of strings never yield a token, so a comment that
//! mentions a field, or a string holding braces, cannot be mistaken for the field or a block.

/// What a token is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A name or a scalar (`version_policy`, `8`, `TYPE_INT64`, `-1.5`).
    Word(String),
    /// A quoted string, unescaped.
    Text(String),
    /// `{`, `[` or `<`.
    Open(char),
    /// `}`, `]` or `>`.
    Close(char),
    Colon,
    /// Any other punctuation (`,`, `;`).
    Other(char),
}

/// A token and the bytes of the text it spans (`start..end`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    pub kind: Kind,
    pub start: usize,
    pub end: usize,
}

impl Token {
    pub fn is_word(&self, word: &str) -> bool {
        matches!(&self.kind, Kind::Word(w) if w == word)
    }
}

fn word_char(c: char) -> bool {
    c.is_alphanumeric() || "_.-+".contains(c)
}

/// The tokens of `text`, in order. An unterminated string runs to the end of the text.
pub fn tokens(text: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut chars = text.char_indices().peekable();
    while let Some((start, c)) = chars.next() {
        let kind = match c {
            c if c.is_whitespace() => continue,
            '#' => {
                for (_, c) in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
                continue;
            }
            '"' | '\'' => {
                let mut value = String::new();
                while let Some((_, d)) = chars.next() {
                    match d {
                        '\\' => {
                            if let Some((_, e)) = chars.next() {
                                value.push(e);
                            }
                        }
                        d if d == c => break,
                        d => value.push(d),
                    }
                }
                Kind::Text(value)
            }
            '{' | '[' | '<' => Kind::Open(c),
            '}' | ']' | '>' => Kind::Close(c),
            ':' => Kind::Colon,
            c if word_char(c) => {
                let mut word = String::from(c);
                while let Some(&(_, d)) = chars.peek() {
                    if !word_char(d) {
                        break;
                    }
                    word.push(d);
                    chars.next();
                }
                Kind::Word(word)
            }
            c => Kind::Other(c),
        };
        let end = chars.peek().map_or(text.len(), |&(i, _)| i);
        out.push(Token { kind, start, end });
    }
    out
}

/// The index of the token that closes the block opened at `tokens[open]`.
pub fn matching_close(tokens: &[Token], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, token) in tokens.iter().enumerate().skip(open) {
        match token.kind {
            Kind::Open(_) => depth += 1,
            Kind::Close(_) => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// A field declared at the top level of a message: its name token and the tokens of its value
/// (`value.start..value.end` indexes `tokens`; one token for a scalar, a whole block for a
/// message or list).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    /// Index of the name's token.
    pub name_token: usize,
    /// Token indices of the value, `start..end` (empty when the text ends after the name).
    pub value: std::ops::Range<usize>,
}

/// The fields declared directly in `tokens` (nested messages are not entered).
pub fn top_level_fields(tokens: &[Token]) -> Vec<Field> {
    let mut fields = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let Kind::Word(name) = &tokens[i].kind else {
            // A stray block at the top level: skip it whole.
            if matches!(tokens[i].kind, Kind::Open(_)) {
                i = matching_close(tokens, i).map_or(tokens.len(), |c| c + 1);
            } else {
                i += 1;
            }
            continue;
        };
        let mut j = i + 1;
        if tokens.get(j).is_some_and(|t| t.kind == Kind::Colon) {
            j += 1;
        }
        let value_end = match tokens.get(j).map(|t| &t.kind) {
            Some(Kind::Open(_)) => matching_close(tokens, j).map_or(tokens.len(), |c| c + 1),
            Some(Kind::Word(_) | Kind::Text(_)) if j > i + 1 => j + 1,
            _ => j,
        };
        fields.push(Field {
            name: name.clone(),
            name_token: i,
            value: j..value_end,
        });
        i = value_end.max(i + 1);
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_strings_yield_no_tokens_of_their_own() {
        let text = "# version_policy { here\nname: \"a { b\" # } trailing\nx: 1\n";
        let kinds: Vec<Kind> = tokens(text).into_iter().map(|t| t.kind).collect();
        assert_eq!(
            kinds,
            [
                Kind::Word("name".into()),
                Kind::Colon,
                Kind::Text("a { b".into()),
                Kind::Word("x".into()),
                Kind::Colon,
                Kind::Word("1".into()),
            ]
        );
    }

    #[test]
    fn token_ranges_cover_their_text() {
        let text = "ab: 'c\\'d' { }";
        let tokens = tokens(text);
        let spans: Vec<&str> = tokens.iter().map(|t| &text[t.start..t.end]).collect();
        assert_eq!(spans, ["ab", ":", "'c\\'d'", "{", "}"]);
    }

    #[test]
    fn fields_are_found_at_the_top_level_only() {
        let text = "a: 1 b { a: 2 c [ 3 ] } d: \"x\" e [ { } ] f < g: 1 >";
        let tokens = tokens(text);
        let names: Vec<String> = top_level_fields(&tokens)
            .into_iter()
            .map(|f| f.name)
            .collect();
        assert_eq!(names, ["a", "b", "d", "e", "f"]);
    }
}
