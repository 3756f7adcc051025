//! The GGUF container (version 2 and 3): its header, metadata and tensor table.
//!
//! GGUF is llama.cpp's single-file model format: a magic, a version, a list of typed
//! key/value metadata (architecture, hyper-parameters, the tokenizer's vocabulary, merges and
//! chat template) and a table of tensors (name, dimensions innermost first, element type,
//! offset from the aligned start of the data). [`Header::read`] parses all of it from any
//! [`Read`] without looking at tensor data, bounding every count and length before it
//! allocates, so a hostile or truncated file is an error, never a huge allocation or a panic.

use std::collections::BTreeMap;
use std::io::Read;

/// `GGUF` read as a little-endian `u32`.
const MAGIC: u32 = 0x4655_4747;
/// The longest string this reader accepts (a chat template or one token is far shorter).
const MAX_STRING: u64 = 1 << 24;
/// The most array elements (a vocabulary of 1 M tokens and its merges fit).
const MAX_ARRAY: u64 = 1 << 24;
/// The most metadata entries and tensors.
const MAX_ENTRIES: u64 = 1 << 20;
/// The most dimensions of a tensor.
const MAX_DIMS: u32 = 4;

/// Why a GGUF file cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("read the GGUF file")]
    Io(#[from] std::io::Error),
    #[error("not a GGUF file (its first 4 bytes are {0:02x?}, not \"GGUF\")")]
    Magic([u8; 4]),
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    #[error("the GGUF header is malformed: {0}")]
    Malformed(String),
}

fn malformed(m: impl Into<String>) -> GgufError {
    GgufError::Malformed(m.into())
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A tensor's element type (`ggml_type`), by its number in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: Self = Self(0);
    pub const F16: Self = Self(1);
    pub const Q4_0: Self = Self(2);
    pub const Q4_1: Self = Self(3);
    pub const Q8_0: Self = Self(8);
    pub const BF16: Self = Self(30);

    /// ggml's name for the type.
    pub fn name(self) -> String {
        let known = [
            "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
            "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
            "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
            "BF16",
        ];
        known
            .get(self.0 as usize)
            .map_or_else(|| format!("type {}", self.0), |s| (*s).to_owned())
    }

    /// Elements per block and bytes per block, for the types this crate dequantises.
    pub fn block(self) -> Option<(u64, u64)> {
        match self {
            Self::F32 => Some((1, 4)),
            Self::F16 | Self::BF16 => Some((1, 2)),
            Self::Q4_0 => Some((32, 18)),
            Self::Q4_1 => Some((32, 20)),
            Self::Q8_0 => Some((32, 34)),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions as GGUF lists them: innermost (contiguous) first, the reverse of PyTorch.
    pub dims: Vec<u64>,
    pub kind: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Elements in the tensor.
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in PyTorch's order (outermost first).
    pub fn torch_shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Bytes of the tensor's data, for a type this crate dequantises and a whole number of
    /// blocks.
    pub fn data_bytes(&self) -> Option<u64> {
        let (per_block, bytes) = self.kind.block()?;
        let n = self.numel();
        n.is_multiple_of(per_block)
            .then(|| (n / per_block).checked_mul(bytes))
            .flatten()
    }
}

/// A parsed GGUF header.
#[derive(Debug, Clone)]
pub struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// Where tensor data starts in the file (aligned to `general.alignment`).
    pub data_start: u64,
}

/// A reader that counts the bytes it consumed.
struct Counted<R> {
    inner: R,
    pos: u64,
}

impl<R: Read> Counted<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut b = [0u8; N];
        self.inner.read_exact(&mut b)?;
        self.pos += N as u64;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(malformed(format!(
                "a string of {len} bytes (at most {MAX_STRING})"
            )));
        }
        let mut b = Vec::new();
        (&mut self.inner).take(len).read_to_end(&mut b)?;
        if b.len() as u64 != len {
            return Err(GgufError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        self.pos += len;
        String::from_utf8(b).map_err(|_| malformed("a string that is not UTF-8"))
    }

    fn value(&mut self, kind: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match kind {
            0 => Value::U64(u64::from(self.bytes::<1>()?[0])),
            1 => Value::I64(i64::from(i8::from_le_bytes(self.bytes()?))),
            2 => Value::U64(u64::from(u16::from_le_bytes(self.bytes()?))),
            3 => Value::I64(i64::from(i16::from_le_bytes(self.bytes()?))),
            4 => Value::U64(u64::from(self.u32()?)),
            5 => Value::I64(i64::from(i32::from_le_bytes(self.bytes()?))),
            6 => Value::F64(f64::from(f32::from_le_bytes(self.bytes()?))),
            7 => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(malformed(format!("a bool of value {b}"))),
            },
            8 => Value::String(self.string()?),
            9 => {
                if depth > 0 {
                    return Err(malformed("an array nested in an array"));
                }
                let inner = self.u32()?;
                let n = self.u64()?;
                if n > MAX_ARRAY {
                    return Err(malformed(format!(
                        "an array of {n} elements (at most {MAX_ARRAY})"
                    )));
                }
                let mut v = Vec::with_capacity(n.min(1 << 16) as usize);
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            k => return Err(malformed(format!("a metadata value of unknown type {k}"))),
        })
    }
}

impl Header {
    /// Parses the header from the start of a GGUF file.
    pub fn read(r: impl Read) -> Result<Self, GgufError> {
        let mut r = Counted { inner: r, pos: 0 };
        let magic = r.bytes::<4>()?;
        if u32::from_le_bytes(magic) != MAGIC {
            return Err(GgufError::Magic(magic));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        if n_tensors > MAX_ENTRIES || n_kv > MAX_ENTRIES {
            return Err(malformed(format!(
                "{n_tensors} tensors and {n_kv} metadata entries (at most {MAX_ENTRIES} each)"
            )));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let kind = r.u32()?;
            let value = r.value(kind, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(malformed(format!("metadata key {key} appears twice")));
            }
        }
        let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(malformed(format!("tensor {name} has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64()?);
            }
            if dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .is_none()
            {
                return Err(malformed(format!("tensor {name} has {dims:?} elements")));
            }
            let kind = GgmlType(r.u32()?);
            let offset = r.u64()?;
            tensors.push(TensorInfo {
                name,
                dims,
                kind,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| malformed("general.alignment is not a power of two"))?,
        };
        let data_start = r.pos.div_ceil(alignment) * alignment;
        Ok(Self {
            version,
            metadata,
            tensors,
            data_start,
        })
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// A GGUF file written in memory, for tests: metadata and F32 tensors.
#[cfg(test)]
pub(crate) fn write_test_file(metadata: &[(&str, Value)], tensors: &[(&str, Vec<u64>)]) -> Vec<u8> {
    fn string(b: &mut Vec<u8>, s: &str) {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    }
    fn kind(v: &Value) -> u32 {
        match v {
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
        }
    }
    fn value(b: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U64(x) => b.extend(x.to_le_bytes()),
            Value::I64(x) => b.extend(x.to_le_bytes()),
            Value::F64(x) => b.extend(x.to_le_bytes()),
            Value::Bool(x) => b.push(u8::from(*x)),
            Value::String(x) => string(b, x),
            Value::Array(a) => {
                b.extend(a.first().map_or(8, kind).to_le_bytes());
                b.extend((a.len() as u64).to_le_bytes());
                for x in a {
                    value(b, x);
                }
            }
        }
    }
    let mut b = Vec::new();
    b.extend(MAGIC.to_le_bytes());
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        string(&mut b, k);
        b.extend(kind(v).to_le_bytes());
        value(&mut b, v);
    }
    let mut offset = 0u64;
    for (name, dims) in tensors {
        string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(GgmlType::F32.0.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (dims.iter().product::<u64>() * 4).div_ceil(32) * 32;
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    let mut x = 0.0f32;
    for (_, dims) in tensors {
        let n = dims.iter().product::<u64>();
        for _ in 0..n {
            x += 0.25;
            b.extend(x.to_le_bytes());
        }
        b.resize(b.len().div_ceil(32) * 32, 0);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF header written by hand: two metadata entries and one F32 tensor.
    pub(crate) fn tiny() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(MAGIC.to_le_bytes());
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        let s = |b: &mut Vec<u8>, s: &str| {
            b.extend((s.len() as u64).to_le_bytes());
            b.extend(s.as_bytes());
        };
        s(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        s(&mut b, "a");
        s(&mut b, "b");
        s(&mut b, "w");
        b.extend(2u32.to_le_bytes());
        b.extend(3u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b
    }

    #[test]
    fn a_header_parses_with_its_metadata_and_tensor_table() {
        let b = tiny();
        let h = Header::read(&b[..]).expect("parse");
        assert_eq!(h.version, 3);
        assert_eq!(
            h.get("general.architecture").and_then(Value::as_str),
            Some("llama")
        );
        let toks = h.get("tokenizer.ggml.tokens").and_then(Value::as_array);
        assert_eq!(toks.map(<[Value]>::len), Some(2));
        let t = h.tensor("w").expect("tensor");
        assert_eq!(
            (t.torch_shape(), t.kind, t.data_bytes()),
            (vec![2, 3], GgmlType::F32, Some(24))
        );
        assert_eq!(h.data_start, (b.len() as u64).div_ceil(32) * 32);
    }

    #[test]
    fn truncated_or_foreign_input_is_an_error_never_a_panic() {
        let b = tiny();
        for cut in 0..b.len() {
            assert!(Header::read(&b[..cut]).is_err(), "cut at {cut}");
        }
        assert!(matches!(
            Header::read(&b"PK\x03\x04rest"[..]),
            Err(GgufError::Magic(_))
        ));
        let mut v = b.clone();
        v[4] = 9;
        assert!(matches!(Header::read(&v[..]), Err(GgufError::Version(9))));
        // A string length far beyond the file is refused before anything is allocated.
        let mut huge = b[..24].to_vec();
        huge.extend(u64::MAX.to_le_bytes());
        assert!(matches!(
            Header::read(&huge[..]),
            Err(GgufError::Malformed(_))
        ));
    }
}
