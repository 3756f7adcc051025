//! Reading safetensors checkpoints: one file, or a directory sharded with
//! `model.safetensors.index.json`, as one name-sorted list of tensors.
//!
//! Nothing is loaded whole. Each file is memory-mapped read-only: a BF16 tensor whose offset
//! is 2-byte aligned is read *in place* through [`Checkpoint::bf16_range`] (no copy out of the
//! page cache, which cost a third of a diff's CPU with positional reads), and the pages a
//! caller is done with are dropped from the mapping with [`Checkpoint::release`], so a diff
//! over a multi-GB pair keeps its resident set to a few chunks. Other dtypes, unaligned
//! tensors, and files that cannot be mapped are read with positional reads into a caller's
//! buffer ([`Checkpoint::read_bf16`]). Headers are validated before any offset is trusted.
//!
//! A mapped file must not change while it is open: Starling treats every published checkpoint
//! as immutable (a trainer writes a new file and renames it into place; it never rewrites one
//! in place), which the hub's snapshot-by-path already relies on.
//!
//! Opening never blocks on what is not a regular file (a FIFO, a device: opened non-blocking
//! and refused), and [`Checkpoint::open_confined`] lets a caller refuse a file by where it
//! really is (symbolic links resolved, from the open descriptor) before a byte of it is read.
//! A directory is one checkpoint: sharded with `model.safetensors.index.json`, or holding
//! `model.safetensors`, or exactly one `*.safetensors` file; a directory of several
//! checkpoints without an index is refused by name instead of being read as one model with
//! every tensor twice.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use starling_proto::delta::bf16::{f16_to_bf16, f32_to_bf16};
use thiserror::Error;

/// The `__metadata__` key under which Starling records a checkpoint's version.
pub const VERSION_KEY: &str = "starling_version";

/// Largest safetensors header accepted (the format itself caps it at 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// Why a checkpoint could not be read.
#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("read {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid safetensors file: {detail}")]
    Invalid { path: PathBuf, detail: String },
    #[error("tensor {name} has dtype {dtype}; only BF16, F16 and F32 can be turned into BF16")]
    UnsupportedDtype { name: String, dtype: String },
    #[error(
        "{path}: no model.safetensors.index.json, model.safetensors or *.safetensors file in this directory"
    )]
    NoWeights { path: PathBuf },
    #[error("checkpoints differ in layout: {0}")]
    LayoutMismatch(String),
    #[error(
        "{path} holds {} checkpoint files ({}) and no model.safetensors.index.json: name one \
         file, or write the index of a sharded checkpoint",
        files.len(),
        list_some(files, 4)
    )]
    SeveralCheckpoints { path: PathBuf, files: Vec<String> },
    #[error("{path} is not a regular file")]
    NotAFile { path: PathBuf },
    #[error("{path} is outside the directories it may be read from")]
    NotAllowed { path: PathBuf },
}

/// The first `n` of `items`, comma-separated, and how many more.
fn list_some(items: &[String], n: usize) -> String {
    let mut s = items.iter().take(n).cloned().collect::<Vec<_>>().join(", ");
    if items.len() > n {
        s.push_str(&format!(" and {} more", items.len() - n));
    }
    s
}

/// Decides whether a file may be read, from its real path (symbolic links resolved).
pub type Gate<'a> = &'a dyn Fn(&Path) -> bool;

/// Opens `path` for reading without blocking on a FIFO or a device, checks it against `gate`
/// (by the path of the open descriptor, so a link swapped in after a check cannot redirect
/// the read) and requires a regular file.
fn open_file(path: &Path, gate: Option<Gate<'_>>) -> Result<File, CheckpointError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err(path))?;
    if let Some(gate) = gate {
        use std::os::fd::AsRawFd;
        let real = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()));
        if !real.is_ok_and(|r| gate(&r)) {
            return Err(CheckpointError::NotAllowed {
                path: path.to_owned(),
            });
        }
    }
    let meta = file.metadata().map_err(io_err(path))?;
    if !meta.is_file() {
        return Err(CheckpointError::NotAFile {
            path: path.to_owned(),
        });
    }
    Ok(file)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Element type stored in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceDtype {
    Bf16,
    F16,
    F32,
}

impl SourceDtype {
    pub fn size(self) -> u64 {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: SourceDtype,
    pub shape: Vec<u64>,
    file: usize,
    /// Absolute byte offset of the first element in the file.
    offset: u64,
}

impl TensorInfo {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// An opened checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    files: Vec<(PathBuf, File)>,
    /// Per file: the length its header declares (8 + header + the end of its last tensor).
    declared: Vec<u64>,
    /// A sharded checkpoint's index: its file name and bytes.
    index: Option<(String, Vec<u8>)>,
    /// One read-only mapping per file (`None`: empty, or the mapping failed).
    maps: Vec<Option<memmap2::Mmap>>,
    tensors: Vec<TensorInfo>,
    version: Option<u64>,
}

impl Checkpoint {
    /// Opens a `.safetensors` file, or a directory with `model.safetensors.index.json`
    /// (sharded), `model.safetensors`, or exactly one `*.safetensors` file.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        Self::open_with(path, None)
    }

    /// As [`Checkpoint::open`], reading only files whose real path `gate` accepts: each is
    /// opened, checked by the path of its open descriptor, and only then read.
    pub fn open_confined(path: &Path, gate: Gate<'_>) -> Result<Self, CheckpointError> {
        Self::open_with(path, Some(gate))
    }

    fn open_with(path: &Path, gate: Option<Gate<'_>>) -> Result<Self, CheckpointError> {
        let mut index = None;
        let files: Vec<PathBuf> = if path.is_dir() {
            let index_path = path.join(INDEX_FILE);
            if index_path.exists() {
                let (shards, bytes) = shards_from_index(&index_path, gate)?;
                index = Some((INDEX_FILE.to_owned(), bytes));
                shards
            } else if path.join("model.safetensors").exists() {
                vec![path.join("model.safetensors")]
            } else {
                let mut v: Vec<PathBuf> = std::fs::read_dir(path)
                    .map_err(io_err(path))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect();
                v.sort();
                match v.len() {
                    0 => {
                        return Err(CheckpointError::NoWeights {
                            path: path.to_owned(),
                        });
                    }
                    1 => v,
                    _ => {
                        return Err(CheckpointError::SeveralCheckpoints {
                            path: path.to_owned(),
                            files: v
                                .iter()
                                .map(|p| {
                                    p.file_name()
                                        .map(|n| n.to_string_lossy().into_owned())
                                        .unwrap_or_default()
                                })
                                .collect(),
                        });
                    }
                }
            }
        } else {
            vec![path.to_owned()]
        };
        let mut opened = Vec::with_capacity(files.len());
        let mut maps = Vec::with_capacity(files.len());
        let mut declared = Vec::with_capacity(files.len());
        let mut tensors = Vec::new();
        let mut version = None;
        for (i, f) in files.into_iter().enumerate() {
            let file = open_file(&f, gate)?;
            let (t, v, end) = parse_header(&f, &file, i)?;
            tensors.extend(t);
            version = version.or(v);
            declared.push(end);
            // SAFETY: published checkpoints are immutable files (module docs); every offset
            // read through the map was validated against the file's size by `parse_header`,
            // and reads are bounds-checked again in `bf16_range`.
            #[allow(unsafe_code)]
            maps.push(unsafe { memmap2::Mmap::map(&file) }.ok());
            opened.push((f, file));
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = tensors.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(CheckpointError::Invalid {
                path: path.to_owned(),
                detail: format!("tensor {} appears twice", w[0].name),
            });
        }
        Ok(Self {
            files: opened,
            declared,
            index,
            maps,
            tensors,
            version,
        })
    }

    /// Each file of the checkpoint: its path, the open file it is read from, and the length its
    /// header declares (8 + header + the end of its last tensor).
    pub fn files(&self) -> impl Iterator<Item = (&Path, &File, u64)> {
        self.files
            .iter()
            .zip(&self.declared)
            .map(|((p, f), &d)| (p.as_path(), f, d))
    }

    /// A sharded checkpoint's index (`model.safetensors.index.json`): its file name and the
    /// bytes read when the checkpoint was opened.
    pub fn index(&self) -> Option<(&str, &[u8])> {
        self.index.as_ref().map(|(n, b)| (n.as_str(), b.as_slice()))
    }

    /// Checks that every file is exactly as long as its header declares: nothing after the
    /// last tensor (a copy of the checkpoint moves exactly the bytes its tensors need).
    pub fn check_lengths(&self) -> Result<(), CheckpointError> {
        for (path, file, declared) in self.files() {
            let len = file.metadata().map_err(io_err(path))?.len();
            if len != declared {
                return Err(CheckpointError::Invalid {
                    path: path.to_owned(),
                    detail: format!(
                        "{len} bytes, but its header and tensors account for {declared}"
                    ),
                });
            }
        }
        Ok(())
    }

    /// The Starling version recorded in the file's `__metadata__` (`starling_version`),
    /// when a Starling tool wrote it.
    pub fn version(&self) -> Option<u64> {
        self.version
    }

    /// Tensors sorted by name.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// Total elements.
    pub fn numel(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::numel).sum()
    }

    /// Reads elements `[start, start + out.len())` of `t` as BF16 bits into `out`.
    pub fn read_bf16(
        &self,
        t: &TensorInfo,
        start: u64,
        out: &mut [u16],
    ) -> Result<(), CheckpointError> {
        let (path, file) = &self.files[t.file];
        let n = out.len();
        let at = t.offset + start * t.dtype.size();
        match t.dtype {
            SourceDtype::Bf16 => {
                file.read_exact_at(bytemuck::cast_slice_mut(out), at)
                    .map_err(io_err(path))?;
            }
            SourceDtype::F16 => {
                file.read_exact_at(bytemuck::cast_slice_mut(out), at)
                    .map_err(io_err(path))?;
                for v in out.iter_mut() {
                    *v = f16_to_bf16(*v);
                }
            }
            SourceDtype::F32 => {
                let mut buf = vec![0u32; n];
                file.read_exact_at(bytemuck::cast_slice_mut(&mut buf), at)
                    .map_err(io_err(path))?;
                for (o, w) in out.iter_mut().zip(&buf) {
                    *o = f32_to_bf16(f32::from_bits(*w));
                }
            }
        }
        Ok(())
    }

    /// Elements `[start, start + len)` of `t` in place, when `t` is BF16, its file is mapped
    /// and the range is 2-byte aligned in it; `None` means "use [`read_bf16`](Self::read_bf16)".
    pub fn bf16_range(&self, t: &TensorInfo, start: u64, len: usize) -> Option<&[u16]> {
        if t.dtype != SourceDtype::Bf16 {
            return None;
        }
        let map = self.maps.get(t.file)?.as_ref()?;
        let at = usize::try_from(t.offset + start * 2).ok()?;
        let bytes = map.get(at..at.checked_add(len.checked_mul(2)?)?)?;
        bytemuck::try_cast_slice(bytes).ok()
    }

    /// Tells the kernel that the caller is done with elements `[start, start + len)` of `t`
    /// (for now): their pages leave this process's resident set but stay in the page cache.
    /// Only whole pages inside the range are released. No slice of that range obtained from
    /// [`bf16_range`](Self::bf16_range) may be in use.
    pub fn release(&self, t: &TensorInfo, start: u64, len: usize) {
        const PAGE: usize = 4096;
        let Some(Some(map)) = self.maps.get(t.file) else {
            return;
        };
        let Ok(lo) = usize::try_from(t.offset + start * t.dtype.size()) else {
            return;
        };
        let hi = (lo + len * t.dtype.size() as usize).min(map.len());
        let (lo, hi) = (lo.div_ceil(PAGE) * PAGE, hi / PAGE * PAGE);
        if lo < hi {
            // SAFETY: a read-only mapping of an immutable file: dropped pages read back the
            // same bytes from the page cache if touched again, and the caller promises no
            // borrowed slice of this range is alive.
            #[allow(unsafe_code)]
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, lo, hi - lo)
            };
        }
    }

    /// Reads a whole tensor as BF16 bits.
    pub fn read_tensor(&self, t: &TensorInfo) -> Result<Vec<u16>, CheckpointError> {
        let mut v = vec![0u16; t.numel() as usize];
        self.read_bf16(t, 0, &mut v)?;
        Ok(v)
    }

    /// Reads every tensor into memory (small models, tests, `delta apply`).
    pub fn read_all(&self) -> Result<BTreeMap<String, Vec<u16>>, CheckpointError> {
        self.tensors
            .iter()
            .map(|t| Ok((t.name.clone(), self.read_tensor(t)?)))
            .collect()
    }

    /// The tensors' names and shapes.
    pub fn layout(&self) -> Layout {
        self.tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect()
    }

    /// Checks that `other` has exactly the same tensor names and shapes; a difference is named
    /// (the tensors `other` lacks and has in excess, or the first shape that differs).
    pub fn check_same_layout(&self, other: &Checkpoint) -> Result<(), CheckpointError> {
        other.check_layout(&self.layout())
    }

    /// Checks that this checkpoint has exactly the tensors of `expected`, with their shapes;
    /// a difference is named (the tensors missing here, those here in excess, or the first
    /// shape that differs).
    pub fn check_layout(&self, expected: &Layout) -> Result<(), CheckpointError> {
        let theirs: BTreeMap<&str, &[u64]> = self
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.as_slice()))
            .collect();
        let missing: Vec<String> = expected
            .keys()
            .filter(|n| !theirs.contains_key(n.as_str()))
            .cloned()
            .collect();
        let extra: Vec<String> = theirs
            .keys()
            .filter(|n| !expected.contains_key(**n))
            .map(|n| (*n).to_owned())
            .collect();
        if !missing.is_empty() || !extra.is_empty() {
            let plural = |n: usize| if n == 1 { "" } else { "s" };
            let mut parts = Vec::new();
            if !missing.is_empty() {
                parts.push(format!(
                    "{} tensor{} of the model missing: {}",
                    missing.len(),
                    plural(missing.len()),
                    list_some(&missing, 8)
                ));
            }
            if !extra.is_empty() {
                parts.push(format!(
                    "{} tensor{} not in the model: {}",
                    extra.len(),
                    plural(extra.len()),
                    list_some(&extra, 8)
                ));
            }
            return Err(CheckpointError::LayoutMismatch(parts.join("; ")));
        }
        for (name, shape) in expected {
            let here = theirs.get(name.as_str()).copied().unwrap_or_default();
            if shape.as_slice() != here {
                return Err(CheckpointError::LayoutMismatch(format!(
                    "tensor {name} has shape {here:?}, the model's is {shape:?}"
                )));
            }
        }
        Ok(())
    }
}

/// Tensor names and shapes, by name.
pub type Layout = BTreeMap<String, Vec<u64>>;

/// The index file of a sharded checkpoint.
const INDEX_FILE: &str = "model.safetensors.index.json";

/// The largest index file read.
const MAX_INDEX: u64 = 64 << 20;

fn shards_from_index(
    index: &Path,
    gate: Option<Gate<'_>>,
) -> Result<(Vec<PathBuf>, Vec<u8>), CheckpointError> {
    use std::io::Read;
    let invalid = |detail: String| CheckpointError::Invalid {
        path: index.to_owned(),
        detail,
    };
    let mut bytes = Vec::new();
    open_file(index, gate)?
        .take(MAX_INDEX + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err(index))?;
    if bytes.len() as u64 > MAX_INDEX {
        return Err(invalid(format!("larger than {MAX_INDEX} bytes")));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| invalid("no weight_map object".into()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut shards: Vec<String> = map
        .values()
        .filter_map(|f| f.as_str().map(str::to_owned))
        .collect();
    if shards.len() != map.len() {
        return Err(invalid("weight_map values must be file names".into()));
    }
    shards.sort();
    shards.dedup();
    for s in &shards {
        if s.contains('/') || s.contains("..") {
            return Err(invalid(format!("shard name {s} leaves the directory")));
        }
    }
    Ok((shards.into_iter().map(|s| dir.join(s)).collect(), bytes))
}

/// A file's tensors, its Starling version, and the length its header declares.
type Header = (Vec<TensorInfo>, Option<u64>, u64);

fn parse_header(path: &Path, file: &File, file_idx: usize) -> Result<Header, CheckpointError> {
    let invalid = |detail: String| CheckpointError::Invalid {
        path: path.to_owned(),
        detail,
    };
    let file_len = file.metadata().map_err(io_err(path))?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact_at(&mut len_bytes, 0)
        .map_err(|_| invalid("shorter than its 8-byte header length".into()))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER || 8 + header_len > file_len {
        return Err(invalid(format!(
            "header length {header_len} does not fit the file of {file_len} bytes"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact_at(&mut header, 8).map_err(io_err(path))?;
    let v: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| invalid(format!("header JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| invalid("header is not a JSON object".into()))?;
    let data_start = 8 + header_len;
    let mut out = Vec::with_capacity(obj.len());
    let mut version = None;
    let mut end = data_start;
    for (name, info) in obj {
        if name == "__metadata__" {
            version = info
                .get(VERSION_KEY)
                .and_then(|v| v.as_str())
                .and_then(|v| v.parse().ok());
            continue;
        }
        let dtype_s = info
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| invalid(format!("{name}: no dtype")))?;
        let dtype = match dtype_s {
            "BF16" => SourceDtype::Bf16,
            "F16" => SourceDtype::F16,
            "F32" => SourceDtype::F32,
            other => {
                return Err(CheckpointError::UnsupportedDtype {
                    name: name.clone(),
                    dtype: other.to_owned(),
                });
            }
        };
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| invalid(format!("{name}: no shape")))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| invalid(format!("{name}: bad dimension")))
            })
            .collect::<Result<_, _>>()?;
        let offs = info
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| invalid(format!("{name}: bad data_offsets")))?;
        let numel = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| invalid(format!("{name}: shape overflows")))?;
        let bytes = numel
            .checked_mul(dtype.size())
            .ok_or_else(|| invalid(format!("{name}: size overflows")))?;
        if offs.1 < offs.0
            || offs.1 - offs.0 != bytes
            || data_start.checked_add(offs.1).is_none_or(|e| e > file_len)
        {
            return Err(invalid(format!(
                "{name}: data_offsets {offs:?} do not match its shape or the file"
            )));
        }
        end = end.max(data_start + offs.1);
        out.push(TensorInfo {
            name: name.clone(),
            dtype,
            shape,
            file: file_idx,
            offset: data_start + offs.0,
        });
    }
    Ok((out, version, end))
}
