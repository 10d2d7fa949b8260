//! TensorBoard event files of a run (`RUN_DIR/tb/events.out.tfevents.<time>.<host>`),
//! written by hand: the format is small and stable, and a protobuf or
//! TensorFlow dependency would be larger than it.
//!
//! A file is a sequence of TFRecords, each `u64 length` (little-endian),
//! the masked CRC-32C of those 8 bytes, the payload, and the masked
//! CRC-32C of the payload. Each payload is a serialized `tensorflow.Event`:
//! the first names the format (`file_version = "brain.Event:2"`), the others
//! carry a `Summary` of scalar values (`simple_value`) at a step. A resumed
//! run cuts the earlier files to its checkpoint's step ([`carry_until`])
//! and starts a new file with a `SessionLog` START at its first step (what
//! TensorBoard's own writers mark a restart with).
//!
//! Fields are encoded as proto3 does (defaults omitted), so the bytes are
//! those TensorBoard's own writer makes for the same event.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::cli::error::CliError;

/// The CRC-32C (Castagnoli) table of the reflected polynomial 0x82F63B78.
const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// CRC-32C of `data` (what TFRecord checksums with).
pub fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |crc, &byte| {
        CRC_TABLE[((crc ^ byte as u32) & 0xff) as usize] ^ (crc >> 8)
    })
}

/// TFRecord's masked CRC: rotated right by 15 bits plus a constant, so that
/// a CRC stored inside checksummed data does not cancel itself out.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord around `payload`.
pub fn record(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc32c(payload).to_le_bytes());
    out
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    varint(out, (u64::from(field) << 3) | 2);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// What an event carries besides its time and step.
pub enum What<'a> {
    /// The file's format (`Event.file_version`, field 3).
    FileVersion(&'a str),
    /// Scalars by tag (`Event.summary`, field 5: `Summary.value`, each
    /// with `tag` (1) and `simple_value` (2), a 32-bit float).
    Scalars(&'a [(String, f64)]),
    /// A session (re)started at the event's step (`Event.session_log`,
    /// field 7, `status = START`).
    SessionStart,
}

/// The serialized `tensorflow.Event` of `what` at `wall_time` (seconds since
/// the epoch) and `step`.
pub fn event(wall_time: f64, step: u64, what: What<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    if wall_time != 0.0 {
        out.push((1 << 3) | 1); // field 1, 64-bit
        out.extend_from_slice(&wall_time.to_le_bytes());
    }
    if step != 0 {
        varint(&mut out, 2 << 3);
        varint(&mut out, step);
    }
    match what {
        What::FileVersion(v) => bytes_field(&mut out, 3, v.as_bytes()),
        What::Scalars(values) => {
            let mut summary = Vec::new();
            for (tag, v) in values {
                let mut value = Vec::new();
                bytes_field(&mut value, 1, tag.as_bytes());
                value.push((2 << 3) | 5); // field 2, 32-bit
                value.extend_from_slice(&(*v as f32).to_le_bytes());
                bytes_field(&mut summary, 1, &value);
            }
            bytes_field(&mut out, 5, &summary);
        }
        // SessionLog { status: START = 1 }.
        What::SessionStart => bytes_field(&mut out, 7, &[1 << 3, 1]),
    }
    out
}

/// The `step` of a serialized event (0 when absent, as proto3 reads it);
/// `None` for bytes that are not a well-formed message.
fn event_step(payload: &[u8]) -> Option<u64> {
    fn read_varint(data: &[u8], at: &mut usize) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *data.get(*at)?;
            *at += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Some(v);
            }
        }
        None
    }
    let (mut at, mut step) = (0, 0);
    while at < payload.len() {
        let key = read_varint(payload, &mut at)?;
        match (key >> 3, key & 7) {
            (2, 0) => step = read_varint(payload, &mut at)?,
            (_, 0) => {
                read_varint(payload, &mut at)?;
            }
            (_, 1) => at += 8,
            (_, 5) => at += 4,
            (_, 2) => at += read_varint(payload, &mut at)? as usize,
            _ => return None,
        }
    }
    (at == payload.len()).then_some(step)
}

/// The records of an event file's bytes whose event step is at most
/// `step`, framed again; reading stops at the first record that is cut
/// short or fails its CRCs (a write the process did not finish).
pub fn records_until(bytes: &[u8], step: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while let Some(head) = bytes.get(at..at + 12) {
        let (len, len_crc) = head.split_at(8);
        if u32::from_le_bytes(len_crc.try_into().unwrap_or_default()) != masked_crc32c(len) {
            break;
        }
        let n = u64::from_le_bytes(len.try_into().unwrap_or_default()) as usize;
        let Some(payload) = bytes.get(at + 12..(at + 12).saturating_add(n)) else {
            break;
        };
        let Some(crc) = bytes.get(at + 12 + n..at + 16 + n) else {
            break;
        };
        if u32::from_le_bytes(crc.try_into().unwrap_or_default()) != masked_crc32c(payload) {
            break;
        }
        if event_step(payload).is_some_and(|s| s <= step) {
            out.extend_from_slice(&bytes[at..at + 16 + n]);
        }
        at += 16 + n;
    }
    out
}

/// Copies the event files of directory `from` into `to` (which may be the
/// same) keeping only the events up to `step`: a resumed run's curves then
/// hold each step once for every reader, not only for TensorBoard's, which
/// would also drop them at the new file's session start.
pub fn carry_until(from: &Path, to: &Path, step: u64) -> Result<(), CliError> {
    let Ok(entries) = std::fs::read_dir(from) else {
        return Ok(());
    };
    std::fs::create_dir_all(to).map_err(|e| CliError::io("cannot create", to, e))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with("events.out.tfevents.") {
            continue;
        }
        let bytes = std::fs::read(entry.path())
            .map_err(|e| CliError::io("cannot read", &entry.path(), e))?;
        let dest = to.join(&name);
        // Not named like an event file: TensorBoard reads any `*tfevents*`.
        let tmp = to.join(".carry.tmp");
        std::fs::write(&tmp, records_until(&bytes, step))
            .map_err(|e| CliError::io("cannot write", &tmp, e))?;
        std::fs::rename(&tmp, &dest).map_err(|e| CliError::io("cannot write", &dest, e))?;
    }
    Ok(())
}

/// Seconds since the epoch, as TensorBoard's `wall_time`.
fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// This machine's name for the file name (as TensorBoard's writers put it
/// there), `localhost` when it cannot be read.
fn host() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let name: String = name
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// An open event file of a run (rank 0 writes it); buffered, and flushed
/// when [`EventWriter::flush`] is called (the training loop does so at each
/// log line, checkpoint and the end of the run).
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// A new event file under `dir` (made if absent), named
    /// `events.out.tfevents.<seconds>.<host>` (with `.N` added should that
    /// name be taken). `resume_at`: the first step of a resumed session,
    /// marked as a session start so that TensorBoard drops the events an
    /// earlier session wrote from that step on.
    pub fn create(dir: &Path, resume_at: Option<u64>) -> Result<Self, CliError> {
        std::fs::create_dir_all(dir).map_err(|e| CliError::io("cannot create", dir, e))?;
        let t = now();
        let base = format!("events.out.tfevents.{:010}.{}", t as u64, host());
        let mut n = 0;
        let (file, path) = loop {
            let name = if n == 0 {
                base.clone()
            } else {
                format!("{base}.{n}")
            };
            let path = dir.join(name);
            match File::options().write(true).create_new(true).open(&path) {
                Ok(f) => break (f, path),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(CliError::io("cannot create", &path, e)),
            }
        };
        let mut w = EventWriter {
            out: BufWriter::new(file),
            path,
        };
        w.write(&event(t, 0, What::FileVersion("brain.Event:2")))?;
        if let Some(step) = resume_at {
            w.write(&event(t, step, What::SessionStart))?;
        }
        w.flush()?;
        Ok(w)
    }

    fn write(&mut self, payload: &[u8]) -> Result<(), CliError> {
        self.out
            .write_all(&record(payload))
            .map_err(|e| CliError::io("cannot write", &self.path, e))
    }

    /// One event with `values` (tag, value) at `step`, now.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> Result<(), CliError> {
        self.write(&event(now(), step, What::Scalars(values)))
    }

    /// Writes what is buffered to the file.
    pub fn flush(&mut self) -> Result<(), CliError> {
        self.out
            .flush()
            .map_err(|e| CliError::io("cannot write", &self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC-32C test vectors of RFC 3720 (iSCSI), appendix B.4, and the
    /// catalogue check value of "123456789".
    #[test]
    fn crc32c_matches_the_published_vectors() {
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        let up: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&up), 0x46DD_794E);
        let down: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c(&down), 0x113F_DB5C);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    /// TFRecord's mask of a known CRC, by its definition
    /// `((crc >> 15) | (crc << 17)) + 0xa282ead8` worked by hand:
    /// 0x8A9136AA rotated right by 15 is 0x6D551522, plus the constant is
    /// 0x0FD7FFFA (mod 2^32).
    #[test]
    fn mask_rotates_and_adds() {
        assert_eq!(masked_crc32c(&[0u8; 32]), 0x0FD7_FFFA);
    }

    /// One scalar event, byte for byte: the protobuf fields written out by
    /// hand from tensorflow/core/util/event.proto and summary.proto, and the
    /// framing's CRCs as TensorBoard's own writer computes them
    /// (`tensorboard.summary.writer.record_writer` over these payload bytes,
    /// run once; see scripts/tensorboard_check.py).
    #[test]
    fn scalar_event_golden_bytes() {
        let payload = event(1.5, 3, What::Scalars(&[("lm loss".into(), 2.0)]));
        let want_payload: Vec<u8> = [
            &[0x09][..],           // wall_time, 64-bit
            &1.5f64.to_le_bytes(), // 1.5
            &[0x10, 0x03],         // step 3
            &[0x2a, 0x10],         // summary, 16 bytes
            &[0x0a, 0x0e],         //   value, 14 bytes
            &[0x0a, 0x07],         //     tag, 7 bytes
            b"lm loss",            //
            &[0x15],               //     simple_value, 32-bit
            &2.0f32.to_le_bytes(), //     2.0
        ]
        .concat();
        assert_eq!(payload, want_payload);
        let framed = record(&payload);
        assert_eq!(framed.len(), 16 + payload.len());
        assert_eq!(&framed[..8], &(payload.len() as u64).to_le_bytes());
        assert_eq!(&framed[12..12 + payload.len()], &payload[..]);
        let crc = |at: usize| u32::from_le_bytes(framed[at..at + 4].try_into().unwrap());
        assert_eq!(crc(8), GOLDEN_LENGTH_CRC);
        assert_eq!(crc(12 + payload.len()), GOLDEN_PAYLOAD_CRC);
    }

    /// The masked CRCs of the golden event's length and payload, as
    /// TensorBoard's record writer framed them.
    const GOLDEN_LENGTH_CRC: u32 = 0x23DF_2F60;
    const GOLDEN_PAYLOAD_CRC: u32 = 0x7D39_C5FA;

    #[test]
    fn file_version_and_session_start_events() {
        let v = event(0.0, 0, What::FileVersion("brain.Event:2"));
        assert_eq!(v, [&[0x1a, 13][..], b"brain.Event:2"].concat());
        assert_eq!(
            event(0.0, 7, What::SessionStart),
            [0x10, 7, 0x3a, 2, 0x08, 1]
        );
        // Varints past one byte: step 300 is 0xac 0x02.
        assert_eq!(event(0.0, 300, What::SessionStart)[..3], [0x10, 0xac, 0x02]);
    }

    /// A resume keeps the events up to its checkpoint's step and stops at a
    /// record cut short, as a crash mid-write leaves it.
    #[test]
    fn records_until_keeps_early_steps_and_drops_a_torn_tail() {
        let file: Vec<u8> = [
            record(&event(1.0, 0, What::FileVersion("brain.Event:2"))),
            record(&event(2.0, 1, What::Scalars(&[("lm loss".into(), 3.0)]))),
            record(&event(3.0, 2, What::Scalars(&[("lm loss".into(), 2.0)]))),
            record(&event(4.0, 3, What::Scalars(&[("lm loss".into(), 1.0)]))),
        ]
        .concat();
        let first_two = record(&event(1.0, 0, What::FileVersion("brain.Event:2"))).len()
            + record(&event(2.0, 1, What::Scalars(&[("lm loss".into(), 3.0)]))).len();
        assert_eq!(records_until(&file, 1), file[..first_two]);
        assert_eq!(records_until(&file, 9), file);
        // Cut inside the last record, or with a flipped payload byte: the
        // complete, intact records before it stay.
        let whole =
            file.len() - record(&event(4.0, 3, What::Scalars(&[("lm loss".into(), 1.0)]))).len();
        assert_eq!(records_until(&file[..file.len() - 3], 9), file[..whole]);
        let mut flipped = file.clone();
        flipped[whole + 14] ^= 1;
        assert_eq!(records_until(&flipped, 9), file[..whole]);
        assert_eq!(event_step(&event(0.0, 300, What::SessionStart)), Some(300));
        assert_eq!(event_step(&[0x10]), None);
    }

    #[test]
    fn writer_makes_a_named_file_and_a_second_one_beside_it() {
        let dir = std::env::temp_dir().join(format!("foldmoe-tb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = EventWriter::create(&dir, None).unwrap();
        w.scalars(1, &[("lm loss".into(), 3.0)]).unwrap();
        w.flush().unwrap();
        let again = EventWriter::create(&dir, Some(2)).unwrap();
        drop(again);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names[0].starts_with("events.out.tfevents."), "{names:?}");
        // The first record is the file version: its wall time (9 bytes)
        // and `brain.Event:2` (15), framed, then the scalar event.
        let first = std::fs::read(dir.join(&names[0])).unwrap();
        assert_eq!(u64::from_le_bytes(first[..8].try_into().unwrap()), 24);
        assert_eq!(&first[12 + 9..12 + 24], b"\x1a\x0dbrain.Event:2");
        assert_eq!(first.len(), (16 + 24) + (16 + 29));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
