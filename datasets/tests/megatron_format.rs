//! The `.bin`/`.idx` format against files Megatron-LM's own writer made
//! (`tests/fixtures/megatron/make_fixture.py`, run once with Megatron-LM's
//! `megatron/core/datasets/indexed_dataset.py`): they read back token for
//! token, and our writer given the same ids writes the same bytes.

use std::path::{Path, PathBuf};

use foldmoe_data::indexed::{bin_path, idx_path, IndexedDataset, IndexedWriter, TokenDtype};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/megatron")
        .join(name)
}

/// The documents (each a list of sequences) and vocabulary the fixture was
/// written from.
fn expected(name: &str) -> (usize, Vec<Vec<Vec<u32>>>) {
    let text = std::fs::read_to_string(fixture(&format!("{name}.json"))).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let docs = serde_json::from_value(v["documents"].clone()).unwrap();
    (v["vocab"].as_u64().unwrap() as usize, docs)
}

#[test]
fn megatron_files_read_back_token_for_token_and_our_writer_matches_byte_for_byte() {
    for (name, dtype) in [("tiny_u16", TokenDtype::U16), ("tiny_i32", TokenDtype::I32)] {
        let (vocab, docs) = expected(name);
        assert_eq!(TokenDtype::for_vocab(vocab), dtype);
        let ds = IndexedDataset::open(&fixture(name)).unwrap();
        assert_eq!(ds.dtype(), dtype, "{name}");
        assert_eq!(ds.documents(), docs.len(), "{name}");
        let mut seq = 0;
        for (d, doc) in docs.iter().enumerate() {
            assert_eq!(ds.document_indices()[d] as usize, seq, "{name} doc {d}");
            for s in doc {
                assert_eq!(&ds.sequence(seq).unwrap(), s, "{name} sequence {seq}");
                seq += 1;
            }
        }
        assert_eq!(ds.sequences(), seq);

        let dir = std::env::temp_dir().join(format!("foldmoe-megatron-{}", std::process::id()));
        let prefix = dir.join(name);
        let mut w = IndexedWriter::create(&prefix, dtype).unwrap();
        for doc in &docs {
            let ids: Vec<u32> = doc.concat();
            let lengths: Vec<usize> = doc.iter().map(Vec::len).collect();
            w.add_document(&ids, &lengths).unwrap();
        }
        w.finalize().unwrap();
        for path in [idx_path, bin_path] {
            assert_eq!(
                std::fs::read(path(&prefix)).unwrap(),
                std::fs::read(path(&fixture(name))).unwrap(),
                "{name}: {}",
                path(&prefix).display()
            );
        }
    }
}
