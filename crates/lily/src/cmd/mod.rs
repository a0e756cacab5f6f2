pub mod bench;
pub mod chat;
pub mod generate;
pub mod inspect;
pub mod pull;
pub mod quantize;
pub mod score;
pub mod serve;

/// Parses `1,2,3` into token ids.
pub fn parse_tokens(text: &str) -> anyhow::Result<Vec<u32>> {
    let tokens = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>().map_err(|_| {
                anyhow::anyhow!("--tokens: {s:?} is not a token id (a non-negative integer)")
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    anyhow::ensure!(!tokens.is_empty(), "--tokens is empty");
    Ok(tokens)
}
