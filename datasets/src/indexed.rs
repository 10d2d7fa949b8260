//! Megatron-Core's indexed dataset (`MMIDIDX`, version 1): a `.bin` of token
//! ids back to back and an `.idx` that says where each sequence starts,
//! byte-compatible with `megatron/core/datasets/indexed_dataset.py`, so files
//! made by Megatron-LM's `tools/preprocess_data.py` load unchanged.
//!
//! `.idx`, all little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 9 | magic `MMIDIDX\x00\x00` |
//! | 8 | version, u64 = 1 |
//! | 1 | dtype code of the `.bin` (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16) |
//! | 8 | sequence count N, u64 |
//! | 8 | document count D, u64 (documents + 1: the indices start at 0) |
//! | 4·N | sequence lengths, i32 (tokens) |
//! | 8·N | sequence pointers, i64 (byte offsets into `.bin`) |
//! | 8·D | document indices, i64 (the first sequence of each document; the last is N) |
//! | N | sequence modes, i8 (multimodal files only; not read) |
//!
//! The writer picks uint16 for a vocabulary below 65,500 and int32 otherwise
//! (Megatron's `DType.optimal_dtype`). Reading goes through `memmap2`, and
//! every field is checked first: a truncated or corrupt file is one error
//! naming the file and the field, never a panic.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use sha2::{Digest, Sha256};

use crate::error::{DataError, Result};

/// The first 9 bytes of every `.idx`.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only version Megatron-Core writes and reads.
pub const VERSION: u64 = 1;
/// Bytes before the sequence lengths.
pub const HEADER_BYTES: usize = 9 + 8 + 1 + 8 + 8;

/// The dtype of a `.bin`'s token ids, by its Megatron code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    /// Code 1.
    U8,
    /// Code 2.
    I8,
    /// Code 3.
    I16,
    /// Code 4.
    I32,
    /// Code 5.
    I64,
    /// Code 8.
    U16,
}

impl TokenDtype {
    /// The dtype of `code`; float codes (6, 7) hold no token ids.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => TokenDtype::U8,
            2 => TokenDtype::I8,
            3 => TokenDtype::I16,
            4 => TokenDtype::I32,
            5 => TokenDtype::I64,
            8 => TokenDtype::U16,
            _ => return None,
        })
    }

    /// Megatron's code of the dtype.
    pub fn code(self) -> u8 {
        match self {
            TokenDtype::U8 => 1,
            TokenDtype::I8 => 2,
            TokenDtype::I16 => 3,
            TokenDtype::I32 => 4,
            TokenDtype::I64 => 5,
            TokenDtype::U16 => 8,
        }
    }

    /// Bytes per id.
    pub fn size(self) -> usize {
        match self {
            TokenDtype::U8 | TokenDtype::I8 => 1,
            TokenDtype::I16 | TokenDtype::U16 => 2,
            TokenDtype::I32 => 4,
            TokenDtype::I64 => 8,
        }
    }

    /// Megatron's choice for a vocabulary of `vocab` tokens: uint16 below
    /// 65,500, else int32.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab < 65_500 {
            TokenDtype::U16
        } else {
            TokenDtype::I32
        }
    }

    /// The id at the start of `b` (at least [`Self::size`] bytes).
    fn read(self, b: &[u8]) -> i64 {
        match self {
            TokenDtype::U8 => i64::from(b[0]),
            TokenDtype::I8 => i64::from(b[0] as i8),
            TokenDtype::I16 => i64::from(i16::from_le_bytes([b[0], b[1]])),
            TokenDtype::U16 => i64::from(u16::from_le_bytes([b[0], b[1]])),
            TokenDtype::I32 => i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            TokenDtype::I64 => i64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        }
    }

    /// Appends `id` to `out`, or `None` if it does not fit the dtype.
    fn write(self, id: u32, out: &mut Vec<u8>) -> Option<()> {
        match self {
            TokenDtype::U8 => out.push(u8::try_from(id).ok()?),
            TokenDtype::I8 => out.push(i8::try_from(id).ok()? as u8),
            TokenDtype::I16 => out.extend(i16::try_from(id).ok()?.to_le_bytes()),
            TokenDtype::U16 => out.extend(u16::try_from(id).ok()?.to_le_bytes()),
            TokenDtype::I32 => out.extend(i32::try_from(id).ok()?.to_le_bytes()),
            TokenDtype::I64 => out.extend(i64::from(id).to_le_bytes()),
        }
        Some(())
    }
}

/// `PATH.idx` of a prefix.
pub fn idx_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".idx")
}

/// `PATH.bin` of a prefix.
pub fn bin_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".bin")
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Writes a `.bin`/`.idx` pair as Megatron's `IndexedDatasetBuilder` does:
/// ids streamed to `.bin`, the index written at [`Self::finalize`]. Both are
/// written to temporary names and renamed at the end, so a failed run
/// leaves no half-written dataset under the prefix.
pub struct IndexedWriter {
    prefix: PathBuf,
    dtype: TokenDtype,
    bin: BufWriter<File>,
    buf: Vec<u8>,
    sequence_lengths: Vec<i32>,
    document_indices: Vec<i64>,
    tokens: u64,
}

impl IndexedWriter {
    /// Starts `prefix.bin`/`prefix.idx` with ids of `dtype`.
    pub fn create(prefix: &Path, dtype: TokenDtype) -> Result<Self> {
        if let Some(dir) = prefix.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| DataError::io("cannot create", dir, e))?;
        }
        let tmp = with_suffix(&bin_path(prefix), ".tmp");
        let file = File::create(&tmp).map_err(|e| DataError::io("cannot create", &tmp, e))?;
        Ok(IndexedWriter {
            prefix: prefix.to_path_buf(),
            dtype,
            bin: BufWriter::with_capacity(1 << 20, file),
            buf: Vec::new(),
            sequence_lengths: Vec::new(),
            document_indices: vec![0],
            tokens: 0,
        })
    }

    /// Megatron's `add_document`: the ids of one document, made of
    /// sequences of `lengths` tokens (summing to `ids.len()`); a document
    /// with no sequence still ends one.
    pub fn add_document(&mut self, ids: &[u32], lengths: &[usize]) -> Result<()> {
        let total: usize = lengths.iter().sum();
        if total != ids.len() {
            return Err(DataError::Invalid(format!(
                "a document of {} tokens given sequence lengths summing to {total}",
                ids.len()
            )));
        }
        self.buf.clear();
        for &id in ids {
            self.dtype.write(id, &mut self.buf).ok_or_else(|| {
                DataError::Invalid(format!(
                    "token id {id} does not fit the dataset's dtype {:?} (code {})",
                    self.dtype,
                    self.dtype.code()
                ))
            })?;
        }
        let tmp = with_suffix(&bin_path(&self.prefix), ".tmp");
        self.bin
            .write_all(&self.buf)
            .map_err(|e| DataError::io("cannot write", &tmp, e))?;
        for &l in lengths {
            let l = i32::try_from(l)
                .map_err(|_| DataError::Invalid(format!("a sequence of {l} tokens exceeds i32")))?;
            self.sequence_lengths.push(l);
        }
        self.document_indices
            .push(self.sequence_lengths.len() as i64);
        self.tokens += ids.len() as u64;
        Ok(())
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Documents written so far.
    pub fn documents(&self) -> usize {
        self.document_indices.len() - 1
    }

    /// Writes the index and renames both files into place.
    pub fn finalize(self) -> Result<()> {
        let bin = bin_path(&self.prefix);
        let bin_tmp = with_suffix(&bin, ".tmp");
        let file = self
            .bin
            .into_inner()
            .map_err(|e| DataError::io("cannot write", &bin_tmp, e.error()))?;
        file.sync_all()
            .map_err(|e| DataError::io("cannot write", &bin_tmp, e))?;
        let idx = idx_path(&self.prefix);
        let idx_tmp = with_suffix(&idx, ".tmp");
        let bytes = encode_index(self.dtype, &self.sequence_lengths, &self.document_indices);
        std::fs::write(&idx_tmp, bytes).map_err(|e| DataError::io("cannot write", &idx_tmp, e))?;
        std::fs::rename(&bin_tmp, &bin).map_err(|e| DataError::io("cannot write", &bin, e))?;
        std::fs::rename(&idx_tmp, &idx).map_err(|e| DataError::io("cannot write", &idx, e))?;
        Ok(())
    }
}

/// The bytes of an `.idx` (Megatron's `_IndexWriter.write`, without
/// sequence modes): pointers are the running byte offsets of the lengths.
pub fn encode_index(
    dtype: TokenDtype,
    sequence_lengths: &[i32],
    document_indices: &[i64],
) -> Vec<u8> {
    let n = sequence_lengths.len();
    let mut out = Vec::with_capacity(HEADER_BYTES + 12 * n + 8 * document_indices.len());
    out.extend_from_slice(MAGIC);
    out.extend(VERSION.to_le_bytes());
    out.push(dtype.code());
    out.extend((n as u64).to_le_bytes());
    out.extend((document_indices.len() as u64).to_le_bytes());
    for &l in sequence_lengths {
        out.extend(l.to_le_bytes());
    }
    let mut ptr = 0i64;
    for &l in sequence_lengths {
        out.extend(ptr.to_le_bytes());
        ptr += i64::from(l) * dtype.size() as i64;
    }
    for &d in document_indices {
        out.extend(d.to_le_bytes());
    }
    out
}

/// A `.bin`/`.idx` pair opened for reading: the index decoded and checked,
/// the ids memory-mapped.
pub struct IndexedDataset {
    prefix: PathBuf,
    dtype: TokenDtype,
    /// Tokens of each sequence.
    sequence_lengths: Vec<u32>,
    /// Byte offset of each sequence in `.bin`.
    sequence_pointers: Vec<u64>,
    /// First sequence of each document, then the sequence count.
    document_indices: Vec<u64>,
    bin: Option<Mmap>,
    /// SHA-256 of the `.idx` bytes and the `.bin` length.
    fingerprint: [u8; 32],
}

impl std::fmt::Debug for IndexedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("prefix", &self.prefix)
            .field("dtype", &self.dtype)
            .field("sequences", &self.sequence_lengths.len())
            .finish()
    }
}

/// Reads a little-endian u64 at `at` of `b` (in bounds).
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl IndexedDataset {
    /// Opens `prefix.idx` and `prefix.bin`, checking every header field and
    /// that every sequence lies inside `.bin`.
    pub fn open(prefix: &Path) -> Result<Self> {
        let idx = idx_path(prefix);
        let idx_file = File::open(&idx).map_err(|e| DataError::io("cannot read", &idx, e))?;
        let idx_len = idx_file
            .metadata()
            .map_err(|e| DataError::io("cannot read", &idx, e))?
            .len();
        let idx_map = if idx_len == 0 {
            None
        } else {
            // SAFETY: read-only, and only read here, while it is open.
            Some(
                unsafe { Mmap::map(&idx_file) }
                    .map_err(|e| DataError::io("cannot map", &idx, e))?,
            )
        };
        let bytes: &[u8] = idx_map.as_deref().unwrap_or(&[]);
        let bin = bin_path(prefix);
        let file = File::open(&bin).map_err(|e| DataError::io("cannot read", &bin, e))?;
        let bin_len = file
            .metadata()
            .map_err(|e| DataError::io("cannot read", &bin, e))?
            .len();
        let bad = |field: &'static str, msg: String| DataError::corrupt(&idx, field, msg);
        if bytes.len() < HEADER_BYTES {
            return Err(bad(
                "header",
                format!(
                    "truncated: {} bytes, a header needs {HEADER_BYTES}",
                    bytes.len()
                ),
            ));
        }
        if &bytes[..9] != MAGIC {
            return Err(bad(
                "magic",
                format!(
                    "{:?}, expected {:?} (not a Megatron MMIDIDX index)",
                    String::from_utf8_lossy(&bytes[..9]),
                    String::from_utf8_lossy(MAGIC)
                ),
            ));
        }
        let version = u64_at(bytes, 9);
        if version != VERSION {
            return Err(bad(
                "version",
                format!("{version}, only version {VERSION} is read"),
            ));
        }
        let code = bytes[17];
        let dtype = TokenDtype::from_code(code).ok_or_else(|| {
            bad(
                "dtype code",
                format!(
                    "{code}: not an integer token dtype (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 8 u16)"
                ),
            )
        })?;
        let n = u64_at(bytes, 18);
        let d = u64_at(bytes, 26);
        // Sizes in u128: a corrupt count must not overflow.
        let need = HEADER_BYTES as u128 + 12 * n as u128 + 8 * d as u128;
        let have = bytes.len() as u128;
        // A multimodal index adds one mode byte per sequence.
        if have != need && have != need + n as u128 {
            return Err(bad(
                "sequence count",
                format!(
                    "{n} sequences and {d} document indices need {need} bytes, the file has {have} (truncated or corrupt)"
                ),
            ));
        }
        if d == 0 {
            return Err(bad(
                "document count",
                "0: the document indices start with 0, so there is at least one".into(),
            ));
        }
        let (n, d) = (n as usize, d as usize);
        let lengths_at = HEADER_BYTES;
        let pointers_at = lengths_at + 4 * n;
        let docs_at = pointers_at + 8 * n;
        let mut sequence_lengths = Vec::with_capacity(n);
        for i in 0..n {
            let at = lengths_at + 4 * i;
            let l = i32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
            let l = u32::try_from(l)
                .map_err(|_| bad("sequence lengths", format!("[{i}] = {l} is negative")))?;
            sequence_lengths.push(l);
        }
        let size = dtype.size() as u64;
        let mut sequence_pointers = Vec::with_capacity(n);
        for (i, &len) in sequence_lengths.iter().enumerate() {
            let p = u64_at(bytes, pointers_at + 8 * i) as i64;
            let end = p as i128 + i128::from(len) * size as i128;
            if p < 0 || !(p as u64).is_multiple_of(size) || end > i128::from(bin_len) {
                return Err(DataError::corrupt(
                    &idx,
                    "sequence pointers",
                    format!(
                        "[{i}] = {p} with {len} tokens of {size} bytes runs past the end of {} ({bin_len} bytes), or is misaligned",
                        bin.display()
                    ),
                ));
            }
            sequence_pointers.push(p as u64);
        }
        let mut document_indices = Vec::with_capacity(d);
        for i in 0..d {
            let v = u64_at(bytes, docs_at + 8 * i) as i64;
            let prev = document_indices.last().copied().unwrap_or(0) as i64;
            let first_ok = i > 0 || v == 0;
            if !first_ok || v < prev || v > n as i64 {
                return Err(bad(
                    "document indices",
                    format!("[{i}] = {v}: must start at 0, never decrease and stay within the {n} sequences"),
                ));
            }
            document_indices.push(v as u64);
        }
        if document_indices.last().copied() != Some(n as u64) {
            return Err(bad(
                "document indices",
                format!(
                    "the last is {}, not the sequence count {n}",
                    document_indices.last().copied().unwrap_or(0)
                ),
            ));
        }
        let map = if bin_len == 0 {
            None
        } else {
            // SAFETY: the file is opened read-only; a dataset is not
            // modified while it is trained on (as with Megatron's memmap).
            Some(unsafe { Mmap::map(&file) }.map_err(|e| DataError::io("cannot map", &bin, e))?)
        };
        let mut h = Sha256::new();
        h.update(bytes);
        h.update(bin_len.to_le_bytes());
        Ok(IndexedDataset {
            prefix: prefix.to_path_buf(),
            dtype,
            sequence_lengths,
            sequence_pointers,
            document_indices,
            bin: map,
            fingerprint: h.finalize().into(),
        })
    }

    /// The prefix it was opened from.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// The `.bin`'s dtype.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Tokens of each sequence.
    pub fn sequence_lengths(&self) -> &[u32] {
        &self.sequence_lengths
    }

    /// First sequence of each document, then the sequence count.
    pub fn document_indices(&self) -> &[u64] {
        &self.document_indices
    }

    /// Number of documents.
    pub fn documents(&self) -> usize {
        self.document_indices.len() - 1
    }

    /// Number of sequences.
    pub fn sequences(&self) -> usize {
        self.sequence_lengths.len()
    }

    /// SHA-256 of the index and the data's length: what a cache of indices
    /// built on this dataset is keyed by.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// Appends to `out` the `len` ids of sequence `seq` from `offset`.
    pub fn read(&self, seq: usize, offset: usize, len: usize, out: &mut Vec<u32>) -> Result<()> {
        let have = self.sequence_lengths.get(seq).copied().unwrap_or(0) as usize;
        if seq >= self.sequences() || offset + len > have {
            return Err(DataError::Invalid(format!(
                "{}: tokens {offset}..{} of sequence {seq} asked, it has {have}",
                self.prefix.display(),
                offset + len
            )));
        }
        let size = self.dtype.size();
        let at = self.sequence_pointers[seq] as usize + offset * size;
        let bytes = match &self.bin {
            Some(map) => &map[at..at + len * size],
            None => &[][..],
        };
        for (k, chunk) in bytes.chunks_exact(size).enumerate() {
            let v = self.dtype.read(chunk);
            let id = u32::try_from(v).map_err(|_| {
                DataError::corrupt(
                    &bin_path(&self.prefix),
                    "token ids",
                    format!("sequence {seq} token {} is {v}, not a token id", offset + k),
                )
            })?;
            out.push(id);
        }
        Ok(())
    }

    /// All ids of sequence `seq`.
    pub fn sequence(&self, seq: usize) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        self.read(
            seq,
            0,
            self.sequence_lengths.get(seq).copied().unwrap_or(0) as usize,
            &mut out,
        )?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("foldmoe-indexed-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Three documents of 3, 0 and 4 tokens.
    fn write_small(prefix: &Path) {
        let mut w = IndexedWriter::create(prefix, TokenDtype::U16).unwrap();
        w.add_document(&[1, 2, 3], &[3]).unwrap();
        w.add_document(&[], &[]).unwrap();
        w.add_document(&[40_000, 5, 6, 7], &[4]).unwrap();
        w.finalize().unwrap();
    }

    #[test]
    fn round_trip_and_dtype_rule() {
        let p = scratch("rt").join("d");
        write_small(&p);
        let ds = IndexedDataset::open(&p).unwrap();
        assert_eq!((ds.sequences(), ds.documents()), (2, 3));
        assert_eq!(ds.document_indices(), &[0, 1, 1, 2]);
        assert_eq!(ds.sequence(1).unwrap(), vec![40_000, 5, 6, 7]);
        let mut part = Vec::new();
        ds.read(1, 1, 2, &mut part).unwrap();
        assert_eq!(part, vec![5, 6]);
        assert_eq!(TokenDtype::for_vocab(65_499), TokenDtype::U16);
        assert_eq!(TokenDtype::for_vocab(65_500), TokenDtype::I32);
        let mut w = IndexedWriter::create(&p, TokenDtype::U16).unwrap();
        let err = w.add_document(&[70_000], &[1]).unwrap_err().to_string();
        assert!(err.contains("70000") && err.contains("U16"), "{err}");
    }

    /// Each corruption is one line naming the file and the field.
    #[test]
    fn corrupt_and_truncated_files_are_one_line_errors() {
        let dir = scratch("bad");
        let good = dir.join("good");
        write_small(&good);
        let idx = std::fs::read(idx_path(&good)).unwrap();
        let bin = std::fs::read(bin_path(&good)).unwrap();
        let case = |name: &str, idx: &[u8], bin: &[u8], field: &str| {
            let p = dir.join(name);
            std::fs::write(idx_path(&p), idx).unwrap();
            std::fs::write(bin_path(&p), bin).unwrap();
            let err = IndexedDataset::open(&p).unwrap_err().to_string();
            assert!(
                err.contains(&idx_path(&p).display().to_string()) && err.contains(field),
                "{name}: {err}"
            );
            assert!(!err.contains('\n'), "{name}: {err}");
        };
        case("short", &idx[..20], &bin, "header");
        let mut m = idx.clone();
        m[0] = b'X';
        case("magic", &m, &bin, "magic");
        let mut m = idx.clone();
        m[9] = 2;
        case("version", &m, &bin, "version: 2");
        let mut m = idx.clone();
        m[17] = 7;
        case("float", &m, &bin, "dtype code: 7");
        case("cut", &idx[..idx.len() - 3], &bin, "sequence count");
        let mut m = idx.clone();
        m[18..26].copy_from_slice(&u64::MAX.to_le_bytes());
        case("count", &m, &bin, "sequence count");
        // The .bin cut short: the last sequence's pointer runs past its end.
        case("bin", &idx, &bin[..bin.len() - 2], "sequence pointers");
        let mut m = idx.clone();
        let ptr1 = HEADER_BYTES + 4 * 2 + 8;
        m[ptr1..ptr1 + 8].copy_from_slice(&1_000i64.to_le_bytes());
        case("pointer", &m, &bin, "sequence pointers");
        let mut m = idx.clone();
        let len0 = HEADER_BYTES;
        m[len0..len0 + 4].copy_from_slice(&(-1i32).to_le_bytes());
        case("negative", &m, &bin, "sequence lengths");
        let mut m = idx.clone();
        let doc2 = HEADER_BYTES + 12 * 2 + 8 * 2;
        m[doc2..doc2 + 8].copy_from_slice(&0i64.to_le_bytes());
        case("docs", &m, &bin, "document indices");
        let missing = IndexedDataset::open(&dir.join("absent"))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("absent.idx"), "{missing}");
    }
}
