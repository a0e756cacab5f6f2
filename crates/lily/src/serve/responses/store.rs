//! Stored conversations for `previous_response_id`: each response's messages (input and
//! reply, as the template reads them), the oldest dropped first past a count or a size.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;

/// Enough for many agents' turns; each entry is a whole conversation, so the bytes bound too.
const MAX_RESPONSES: usize = 1024;
const MAX_BYTES: usize = 256 << 20;

#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    order: VecDeque<String>,
    conversations: HashMap<String, (Vec<Value>, usize)>,
    bytes: usize,
}

impl ResponseStore {
    /// The messages of the conversation that ended with response `id`, if it is still kept.
    pub fn conversation(&self, id: &str) -> Option<Vec<Value>> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.conversations.get(id).map(|(c, _)| c.clone())
    }

    pub fn insert(&self, id: String, conversation: Vec<Value>) {
        let bytes: usize = conversation.iter().map(|m| m.to_string().len()).sum();
        if bytes > MAX_BYTES {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while inner.order.len() >= MAX_RESPONSES || inner.bytes + bytes > MAX_BYTES {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some((_, size)) = inner.conversations.remove(&oldest) {
                inner.bytes -= size;
            }
        }
        inner.order.push_back(id.clone());
        inner.bytes += bytes;
        inner.conversations.insert(id, (conversation, bytes));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_oldest_conversations_go_first_past_the_count() {
        let store = ResponseStore::default();
        for i in 0..MAX_RESPONSES + 2 {
            store.insert(format!("resp_{i}"), vec![json!({"n": i})]);
        }
        assert_eq!(store.conversation("resp_0"), None);
        assert_eq!(store.conversation("resp_1"), None);
        assert_eq!(store.conversation("resp_2"), Some(vec![json!({"n": 2})]));
        let last = format!("resp_{}", MAX_RESPONSES + 1);
        assert_eq!(
            store.conversation(&last),
            Some(vec![json!({"n": MAX_RESPONSES + 1})])
        );
    }
}
