//! (query, document) pairs tokenized as a cross-encoder reads them
//! ([`Tokenizer::encode_pairs`]): the ids, attention mask and token types of
//! `transformers` 5 (`tokenizer(queries, documents, truncation=True, max_length=N,
//! padding=True)`) on the BERT, XLM-R, RoBERTa and ModernBERT fixtures' tokenizers, at 16
//! tokens (the longer side truncated first) and at 512 (`tests/fixtures/rerank/pairs.json`,
//! written by `scripts/make_pair_fixtures.py`); mismatched lists refused.

use std::path::Path;

use candle_core::Device;
use gradcache::hub::Tokenizer;
use gradcache::Error;

#[test]
fn pairs_tokenize_as_transformers_does() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/rerank/pairs.json")).unwrap(),
    )
    .unwrap();
    let texts =
        |key: &str| -> Vec<String> { serde_json::from_value(fixture[key].clone()).unwrap() };
    let (queries, documents) = (texts("queries"), texts("documents"));
    let q: Vec<&str> = queries.iter().map(String::as_str).collect();
    let d: Vec<&str> = documents.iter().map(String::as_str).collect();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 8);
    for case in cases {
        let family = case["family"].as_str().unwrap();
        let max_len = case["max_len"].as_u64().unwrap() as usize;
        let file = root
            .join("tests/fixtures/families")
            .join(family)
            .join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&file, max_len).unwrap();
        let batch = tokenizer.encode_pairs(&q, &d, &Device::Cpu).unwrap();
        let want =
            |key: &str| -> Vec<Vec<u32>> { serde_json::from_value(case[key].clone()).unwrap() };
        let what = format!("{family} at {max_len}");
        assert_eq!(
            batch.input_ids.to_vec2::<u32>().unwrap(),
            want("input_ids"),
            "{what}"
        );
        assert_eq!(
            batch.attention_mask.to_vec2::<u32>().unwrap(),
            want("attention_mask"),
            "{what}"
        );
        assert_eq!(
            batch.token_type_ids.to_vec2::<u32>().unwrap(),
            want("token_type_ids"),
            "{what}"
        );
    }
    // One document per query.
    let tokenizer = Tokenizer::from_file(
        &root.join("tests/fixtures/families/bert/tokenizer.json"),
        32,
    )
    .unwrap();
    match tokenizer.encode_pairs(&q, &d[..2], &Device::Cpu) {
        Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "pairs"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}
