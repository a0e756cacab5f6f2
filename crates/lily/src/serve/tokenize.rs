//! `POST /tokenize` and `POST /detokenize`, in the shapes llama.cpp's server and vLLM both
//! answer, so that clients of either work: text (`content` or `prompt`) or chat `messages`
//! through the template in, ids out; ids in, text out. Neither touches the engine.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use lily_chat::TextModel;
use serde_json::{Map, Value, json};

use super::error::{ApiError, ApiResult};
use super::request::{parse_body, parse_messages, parse_template_kwargs, parse_tools};
use super::routes::{AppState, read_body};

pub async fn tokenize(State(app): State<Arc<AppState>>, body: Body) -> Response {
    let run = |app: Arc<AppState>, body: Map<String, Value>| {
        tokenize_body(&app.text, &body, app.default_thinking, app.max_seq)
    };
    handle(app, body, run)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub async fn detokenize(State(app): State<Arc<AppState>>, body: Body) -> Response {
    let run = |app: Arc<AppState>, body: Map<String, Value>| {
        detokenize_body(&app.text, &body, app.vocab_size)
    };
    handle(app, body, run)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Reads the body, checks `model` when given (both servers make it optional), and runs `work`
/// off the async threads: a long text or a template takes a while to tokenise.
async fn handle(
    app: Arc<AppState>,
    body: Body,
    work: impl FnOnce(Arc<AppState>, Map<String, Value>) -> ApiResult<Value> + Send + 'static,
) -> ApiResult<Response> {
    let body = parse_body(&read_body(body, &app).await?)?;
    match body.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(model)) => app.check_model(model)?,
        Some(_) => return Err(ApiError::param("model", "must be a string")),
    }
    let answer = tokio::task::spawn_blocking(move || work(app, body))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing: {e}")))??;
    Ok(Json(answer).into_response())
}

fn flag(body: &Map<String, Value>, name: &str, default: bool) -> ApiResult<bool> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::param(name, "must be true or false")),
    }
}

/// `{"content" | "prompt": text}` or `{"messages": [...]}` to
/// `{"tokens", "count", "max_model_len"}`; `with_pieces` (llama.cpp) makes each token
/// `{"id", "piece"}`, `return_token_strs` (vLLM) adds `token_strs`.
pub fn tokenize_body(
    text: &TextModel,
    body: &Map<String, Value>,
    default_thinking: bool,
    max_seq: usize,
) -> ApiResult<Value> {
    let tokenizer = &text.tokenizer;
    let ids = if body.contains_key("messages") {
        let mut context = parse_template_kwargs(body, default_thinking)?;
        context.insert("messages".into(), parse_messages(body)?.into());
        let tools = parse_tools(body)?;
        if !tools.is_empty() {
            context.insert("tools".into(), tools.into());
        }
        let generation_prompt = flag(body, "add_generation_prompt", true)?;
        context.insert("add_generation_prompt".into(), generation_prompt.into());
        let rendered = text
            .template
            .render(&Value::Object(context))
            .map_err(|e| ApiError::param("messages", format!("{e:#}")))?;
        // vLLM's default for chat: the template already wrote every special token.
        encode(
            tokenizer,
            &rendered,
            flag(body, "add_special_tokens", false)?,
        )?
    } else {
        let (field, content) = match (body.get("content"), body.get("prompt")) {
            (Some(c), None) => ("content", c),
            (None, Some(p)) => ("prompt", p),
            (Some(_), Some(_)) => {
                return Err(ApiError::param(
                    "prompt",
                    "give content or prompt, not both",
                ));
            }
            (None, None) => {
                return Err(ApiError::param(
                    "content",
                    "is required (or prompt, or messages)",
                ));
            }
        };
        let Value::String(content) = content else {
            return Err(ApiError::param(field, "must be a string"));
        };
        // llama.cpp calls it add_special, vLLM add_special_tokens; Qwen has no BOS either way.
        let add_special = match body.get("add_special") {
            Some(_) => flag(body, "add_special", false)?,
            None => flag(body, "add_special_tokens", true)?,
        };
        encode(tokenizer, content, add_special)?
    };
    let piece = |id: u32| tokenizer.decode_with_special(&[id]);
    let tokens: Vec<Value> = if flag(body, "with_pieces", false)? {
        ids.iter()
            .map(|&id| json!({"id": id, "piece": piece(id)}))
            .collect()
    } else {
        ids.iter().map(|&id| id.into()).collect()
    };
    let mut answer = json!({"tokens": tokens, "count": ids.len(), "max_model_len": max_seq});
    if flag(body, "return_token_strs", false)? {
        answer["token_strs"] = ids.iter().map(|&id| piece(id)).collect();
    }
    Ok(answer)
}

fn encode(tokenizer: &lily_chat::TextTokenizer, text: &str, special: bool) -> ApiResult<Vec<u32>> {
    let ids = if special {
        tokenizer.encode_with_special(text)
    } else {
        tokenizer.encode(text)
    };
    ids.map_err(|e| ApiError::invalid(format!("{e:#}")))
}

/// `{"tokens": [...]}` to the text, special tokens written out, as `content` (llama.cpp) and
/// `prompt` (vLLM).
pub fn detokenize_body(
    text: &TextModel,
    body: &Map<String, Value>,
    vocab_size: usize,
) -> ApiResult<Value> {
    let Some(tokens) = body.get("tokens") else {
        return Err(ApiError::param("tokens", "is required"));
    };
    let Value::Array(tokens) = tokens else {
        return Err(ApiError::param("tokens", "must be a list of token ids"));
    };
    let ids = tokens
        .iter()
        .enumerate()
        .map(
            |(i, v)| match v.as_u64().and_then(|id| u32::try_from(id).ok()) {
                Some(id) if (id as usize) < vocab_size => Ok(id),
                Some(id) => Err(ApiError::param(
                    format!("tokens[{i}]"),
                    format!("token id {id} is outside the vocabulary of {vocab_size}"),
                )),
                None => Err(ApiError::param(
                    format!("tokens[{i}]"),
                    "must be a non-negative integer",
                )),
            },
        )
        .collect::<ApiResult<Vec<u32>>>()?;
    let content = text.tokenizer.decode_with_special(&ids);
    Ok(json!({"content": content, "prompt": content}))
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use super::*;

    fn text() -> &'static TextModel {
        static TEXT: OnceLock<TextModel> = OnceLock::new();
        TEXT.get_or_init(|| TextModel::embedded().unwrap())
    }

    fn body(value: Value) -> Map<String, Value> {
        value.as_object().unwrap().clone()
    }

    fn ids(answer: &Value) -> Vec<u32> {
        serde_json::from_value(answer["tokens"].clone()).unwrap()
    }

    #[test]
    fn text_and_chat_tokenize_as_the_oracle_and_round_trip() {
        // "Hello, how are you?" (tokenizer_oracle.json).
        for field in ["content", "prompt"] {
            let answer = tokenize_body(
                text(),
                &body(json!({field: "Hello, how are you?"})),
                true,
                512,
            )
            .unwrap();
            assert_eq!(ids(&answer), [9419, 11, 1204, 513, 488, 30]);
            assert_eq!(
                (answer["count"].clone(), answer["max_model_len"].clone()),
                (6.into(), 512.into())
            );
        }
        // The chat prompt the server generates from (serve::prompt's test has the same ids).
        let chat = json!({"messages": [{"role": "user", "content": "Hello, how are you?"}],
                          "chat_template_kwargs": {"enable_thinking": false}});
        let answer = tokenize_body(text(), &body(chat.clone()), true, 512).unwrap();
        let expected = [
            248045, 846, 198, 9419, 11, 1204, 513, 488, 30, 248046, 198, 248045, 74455, 198,
            248068, 271, 248069, 271,
        ];
        assert_eq!(ids(&answer), expected);
        let mut history = chat;
        history["add_generation_prompt"] = false.into();
        assert_eq!(
            ids(&tokenize_body(text(), &body(history), true, 512).unwrap()),
            expected[..11]
        );

        let back = detokenize_body(text(), &body(json!({"tokens": expected})), 248320).unwrap();
        let rendered = "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n\
                        <think>\n\n</think>\n\n";
        assert_eq!(back["content"], rendered);
        assert_eq!(back["prompt"], rendered);
        let again = tokenize_body(text(), &body(json!({"content": rendered})), true, 512).unwrap();
        assert_eq!(ids(&again), expected);
    }

    #[test]
    fn pieces_and_token_strings_name_each_token() {
        let request =
            json!({"content": "Hello, how", "with_pieces": true, "return_token_strs": true});
        let answer = tokenize_body(text(), &body(request), true, 512).unwrap();
        assert_eq!(
            answer["tokens"],
            json!([{"id": 9419, "piece": "Hello"}, {"id": 11, "piece": ","},
                   {"id": 1204, "piece": " how"}])
        );
        assert_eq!(answer["token_strs"], json!(["Hello", ",", " how"]));
    }

    #[test]
    fn bad_requests_name_the_field() {
        let cases = [
            (json!({}), "content"),
            (json!({"content": 3}), "content"),
            (json!({"content": "a", "prompt": "b"}), "prompt"),
            (json!({"content": "a", "add_special": "yes"}), "add_special"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
        ];
        for (request, param) in cases {
            let error = tokenize_body(text(), &body(request.clone()), true, 512).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{request}");
        }
        for (request, param) in [
            (json!({}), "tokens"),
            (json!({"tokens": "1,2"}), "tokens"),
            (json!({"tokens": [1, -2]}), "tokens[1]"),
            (json!({"tokens": [1, 248320]}), "tokens[1]"),
        ] {
            let error = detokenize_body(text(), &body(request.clone()), 248320).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{request}");
        }
    }
}
