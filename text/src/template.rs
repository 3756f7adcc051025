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
        env.add_template_owned(NAME, source.to_owned())
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
