//! Chat templates rendered as transformers renders them.
//!
//! transformers compiles a model's `chat_template` with Jinja2 (`ImmutableSandboxedEnvironment`,
//! `trim_blocks=True`, `lstrip_blocks=True`, the `loopcontrols` extension), adds the globals
//! `raise_exception(msg)` and `strftime_now(fmt)` and a `tojson` filter that is Python's
//! `json.dumps(x, ensure_ascii=False, indent=…, separators=…, sort_keys=…)`, and renders it
//! with `messages`, `tools`, `documents`, `add_generation_prompt` and the tokenizer's special
//! tokens (`bos_token`, `eos_token`, …). [`ChatTemplate`] does the same with `minijinja`:
//! the same whitespace control and loop controls, Python's string and dict methods through
//! `minijinja-contrib`'s pycompat, the same three additions, and the same variables. A template
//! that raises (through `raise_exception` or an error of its own) is an error quoting it.
//!
//! transformers also registers a Jinja2 extension for `{% generation %}` … `{% endgeneration %}`
//! (it marks the assistant's tokens for `return_assistant_tokens_mask`). Its block renders its
//! body unchanged, in a scope of its own, and its tags are ordinary block tags (so
//! `trim_blocks`, `lstrip_blocks` and `-` apply to them). minijinja does not know the tag, so
//! before compiling, [`generation_blocks_as_with`] rewrites each such tag into
//! `{% with %}` … `{% endwith %}`: a block tag with the same whitespace behaviour, a scope of
//! its own and no output of its own. Text inside string literals, comments and raw blocks is
//! left alone. Without it, a template written for assistant masks would not compile and the
//! hub would refuse the model.

use std::borrow::Cow;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, context};
use serde::Serialize;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// Why a chat cannot be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    #[error("the chat template failed for these messages: {0}")]
    Render(String),
}

/// A compiled chat template and the special tokens it may use.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    specials: Vec<(String, String)>,
    source: String,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; `specials` are the tokenizer's special tokens by their
    /// `tokenizer_config.json` key (`bos_token` → `<|im_start|>`).
    pub fn new(source: &str, specials: Vec<(String, String)>) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, generation_blocks_as_with(source).into_owned())
            .map_err(|e| TemplateError::Compile(describe(&e)))?;
        Ok(Self {
            env,
            specials,
            source: source.to_owned(),
        })
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (with the generation prompt when `add_generation_prompt`).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TemplateError::Compile(describe(&e)))?;
        let specials: std::collections::BTreeMap<&str, &str> = self
            .specials
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let ctx = context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            tools => Value::from(()),
            documents => Value::from(()),
            ..Value::from_serialize(&specials)
        };
        tmpl.render(ctx)
            .map_err(|e| TemplateError::Render(describe(&e)))
    }
}

/// `source` with every `{% generation %}` / `{% endgeneration %}` tag (whitespace control
/// included: `{%- generation -%}`) rewritten as `{% with %}` / `{% endwith %}`, which
/// minijinja renders as Jinja2 renders transformers' generation block (see the module doc).
/// It scans as Jinja2's lexer does: comments and `{% raw %}` blocks are skipped whole, and
/// inside `{{ … }}` and `{% … %}` string literals and brackets are followed, so a tag written
/// inside a string or a raw block is left as it is.
pub fn generation_blocks_as_with(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let b = source.as_bytes();
    let mut out = String::with_capacity(source.len());
    let mut copied = 0;
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] != b'{' {
            i += 1;
            continue;
        }
        match b[i + 1] {
            b'#' => i = find(source, i + 2, "#}").map_or(b.len(), |j| j + 2),
            b'{' => i = code_end(b, i + 2, b'}'),
            b'%' => {
                let end = code_end(b, i + 2, b'%');
                let (name, at) = tag_name(source, i, end);
                match name {
                    "raw" => i = raw_end(source, end),
                    "generation" | "endgeneration" => {
                        out.push_str(&source[copied..at]);
                        out.push_str(if name == "generation" {
                            "with"
                        } else {
                            "endwith"
                        });
                        copied = at + name.len();
                        i = end;
                    }
                    _ => i = end,
                }
            }
            _ => i += 1,
        }
    }
    if copied == 0 {
        return Cow::Borrowed(source);
    }
    out.push_str(&source[copied..]);
    Cow::Owned(out)
}

fn find(s: &str, from: usize, needle: &str) -> Option<usize> {
    s.get(from..)?.find(needle).map(|j| from + j)
}

/// Where the expression or statement starting at `from` ends: just after the first
/// `closer` `}` (`}}` or `%}`) outside string literals and brackets; the end of `b` if none.
fn code_end(b: &[u8], from: usize, closer: u8) -> usize {
    let mut depth = 0usize;
    let mut i = from;
    while i < b.len() {
        match b[i] {
            q @ (b'\'' | b'"') => {
                i += 1;
                while i < b.len() && b[i] != q {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' => depth = depth.saturating_sub(1),
            b'}' if depth > 0 => depth -= 1,
            c if c == closer && depth == 0 && b.get(i + 1) == Some(&b'}') => return i + 2,
            _ => {}
        }
        i += 1;
    }
    b.len()
}

/// The statement name of the block tag `source[start..end]` (`{%- name -%}`) and where the
/// name starts, when the tag holds that name alone; `""` otherwise.
fn tag_name(source: &str, start: usize, end: usize) -> (&str, usize) {
    let inner = source
        .get(start + 2..end.saturating_sub(2).max(start + 2))
        .unwrap_or("");
    let lead = inner.len() - inner.trim_start_matches(['-', '+']).trim_start().len();
    let body = inner[lead..]
        .trim_end()
        .trim_end_matches(['-', '+'])
        .trim_end();
    if !body.is_empty() && body.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_') {
        (body, start + 2 + lead)
    } else {
        ("", start)
    }
}

/// Just after the `{% endraw %}` that closes a raw block whose body starts at `from` (found
/// as Jinja2 finds it: the first `{%` followed by `endraw` and the tag's end, nothing parsed
/// in between).
fn raw_end(source: &str, from: usize) -> usize {
    let mut i = from;
    while let Some(j) = find(source, i, "{%") {
        let rest = source[j + 2..].trim_start_matches(['-', '+']).trim_start();
        if let Some(after) = rest.strip_prefix("endraw") {
            let after = after.trim_start();
            let after = after.strip_prefix(['-', '+']).unwrap_or(after);
            if after.starts_with("%}") {
                return source.len() - after.len() + 2;
            }
        }
        i = j + 2;
    }
    source.len()
}

/// The error's message and what caused it (minijinja's chain).
fn describe(e: &Error) -> String {
    let mut s = match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_owned(),
        _ => e.to_string(),
    };
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=…, separators=…, sort_keys=…)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let (item, key) = match separators.as_deref() {
        Some([i, k]) => (i.clone(), k.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut out = String::new();
    crate::pyjson::dump(
        &json,
        &crate::pyjson::Style {
            indent,
            item,
            key,
            sort_keys: sort_keys.unwrap_or(false),
        },
        0,
        &mut out,
    );
    Ok(Value::from_safe_string(out))
}

/// `strftime_now(format)`: the current UTC time formatted with the C directives templates
/// use (`%Y %m %d %e %H %M %S %b %B %a %A %y %j %p %%`).
fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    crate::pyjson::strftime(&format, secs)
        .map_err(|d| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {d}")))
}
