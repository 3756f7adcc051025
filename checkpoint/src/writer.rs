//! Writing BF16 safetensors files atomically and with bounded memory.
//!
//! The header is written first (offsets are known from shapes), then tensors are written
//! in name order, range by range. Everything goes to a temporary file in the target's
//! directory that is fsynced and renamed into place only by [`SafetensorsWriter::finish`];
//! dropping the writer (an error on the way) removes the temporary file, so a failed write
//! never leaves a partial output behind.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::json;

/// An output file that appears at its path only when finished.
#[derive(Debug)]
pub struct AtomicFile {
    tmp: PathBuf,
    dest: PathBuf,
    file: Option<BufWriter<File>>,
}

impl AtomicFile {
    pub fn create(dest: &Path) -> std::io::Result<Self> {
        let dir = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
        let file = File::create(&tmp)?;
        Ok(Self {
            tmp,
            dest: dest.to_owned(),
            file: Some(BufWriter::with_capacity(1 << 20, file)),
        })
    }

    pub fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        match self.file.as_mut() {
            Some(f) => f.write_all(b),
            None => Err(std::io::Error::other("file already finished")),
        }
    }

    /// Flushes, fsyncs and renames into place.
    pub fn commit(mut self) -> std::io::Result<()> {
        let f = self
            .file
            .take()
            .ok_or_else(|| std::io::Error::other("file already finished"))?;
        let f = f.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&self.tmp, &self.dest)?;
        if let Some(dir) = self.dest.parent().filter(|p| !p.as_os_str().is_empty())
            && let Ok(d) = File::open(dir)
        {
            // Make the rename durable too; a failure here loses nothing already written.
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Streams a BF16 safetensors file.
#[derive(Debug)]
pub struct SafetensorsWriter {
    out: AtomicFile,
    layout: Vec<(String, u64)>,
    current: usize,
    written: u64,
}

impl SafetensorsWriter {
    /// `tensors`: (name, shape), in any order; data must then be written in name order.
    /// `version` is recorded in `__metadata__` when given.
    pub fn create(
        dest: &Path,
        tensors: &[(String, Vec<u64>)],
        version: Option<u64>,
    ) -> std::io::Result<Self> {
        let (header, _) = header_bytes(tensors, version);
        let mut sorted: Vec<&(String, Vec<u64>)> = tensors.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let layout = sorted
            .iter()
            .map(|(n, shape)| (n.clone(), shape.iter().product()))
            .collect();
        let mut out = AtomicFile::create(dest)?;
        out.write_all(&header)?;
        Ok(Self {
            out,
            layout,
            current: 0,
            written: 0,
        })
    }

    /// Appends the next elements, in name order of tensors.
    pub fn write(&mut self, data: &[u16]) -> std::io::Result<()> {
        let mut left = data.len() as u64;
        while left > 0 {
            let Some((_, n)) = self.layout.get(self.current) else {
                return Err(std::io::Error::other("more data than the tensors hold"));
            };
            let take = left.min(n - self.written);
            self.written += take;
            left -= take;
            if self.written == *n {
                self.current += 1;
                self.written = 0;
            }
        }
        self.out.write_all(bytemuck::cast_slice(data))
    }

    pub fn finish(mut self) -> std::io::Result<()> {
        while self.layout.get(self.current).is_some_and(|(_, n)| *n == 0) {
            self.current += 1;
        }
        if self.current != self.layout.len() {
            return Err(std::io::Error::other("fewer data than the tensors hold"));
        }
        self.out.commit()
    }
}

/// The bytes before the data of a BF16 safetensors file laid out in name order (length
/// prefix and JSON header padded to 8 bytes), and the length of the data after them.
pub fn header_bytes(tensors: &[(String, Vec<u64>)], version: Option<u64>) -> (Vec<u8>, u64) {
    let mut sorted: Vec<&(String, Vec<u64>)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut header = serde_json::Map::new();
    let mut meta = json!({"format": "pt", "producer": "starling"});
    if let Some(v) = version {
        meta[crate::safetensors::VERSION_KEY] = json!(v.to_string());
    }
    header.insert("__metadata__".into(), meta);
    let mut off = 0u64;
    for (name, shape) in &sorted {
        let n: u64 = shape.iter().product();
        header.insert(
            name.clone(),
            json!({"dtype": "BF16", "shape": shape, "data_offsets": [off, off + 2 * n]}),
        );
        off += 2 * n;
    }
    // Serializing a map of strings and numbers cannot fail.
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap_or_default();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    (out, off)
}
