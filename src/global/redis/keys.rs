//! How a bucket's identity becomes a Redis key's name: the key's bytes written out, or hashed
//! with a secret so that Redis never holds them.

use std::borrow::Cow;
use std::hash::Hasher;
use std::net::IpAddr;
use std::sync::Arc;

use siphasher::sip128::{Hasher128, SipHasher24};

use crate::global::redis::RedisGlobalStore;
use crate::quota::BucketKey;

const HEX: &[u8; 16] = b"0123456789ABCDEF";

impl<K> RedisGlobalStore<K> {
    /// Names keys in Redis by a keyed hash of their bytes instead of the bytes themselves:
    /// `<prefix>{<32 hex digits>}:<scope>`, SipHash-2-4's 128-bit output under `secret`. For
    /// keys that are secrets (API keys) or personal data (client addresses): whoever reads
    /// Redis, its logs or its `MONITOR` stream learns nothing of them, and every key's name has
    /// one length however long the key. Without the secret no one can find a key's buckets
    /// or make two keys share one. Every host of a fleet must use the same secret; turning it
    /// on, off or to another secret moves every key to new, full buckets (and the old ones
    /// expire once full).
    #[must_use]
    pub fn with_hashed_keys(mut self, secret: [u8; 16]) -> Self {
        self.hashed_keys = Some(secret);
        self
    }
}

impl<K: RedisKey> RedisGlobalStore<K> {
    /// The Redis key holding bucket `key`: `<prefix>{<key>}:<scope>` for the layer called
    /// `default`, such as `throttle:{user-1}:per-second` or `throttle:{acme}:tenant/per-day`,
    /// and `<prefix>{<key>}:<layer>:<scope>` for another, such as
    /// `throttle:{user-1}:api:per-second`.
    /// With [`with_hashed_keys`](Self::with_hashed_keys), `<key>` is the key's hash.
    pub fn redis_key(&self, key: &BucketKey<K>) -> Vec<u8> {
        let bytes = key.key().key_bytes();
        let scope = key.scope();
        // Room for the whole name at once (an encoded byte may still grow it).
        let key_len = match self.hashed_keys {
            Some(_) => 32,
            None => bytes.len(),
        };
        let layer_len = match key.in_default_layer() {
            true => 0,
            false => key.layer().len() + 1,
        };
        let mut out = Vec::with_capacity(self.prefix.len() + key_len + 3 + layer_len + scope.len());
        out.extend_from_slice(&self.prefix);
        out.push(b'{');
        match &self.hashed_keys {
            Some(secret) => push_hashed(&mut out, secret, &bytes),
            None => push_encoded(&mut out, &bytes),
        }
        out.push(b'}');
        out.push(b':');
        // Names are ASCII letters, digits and `-_.` (`/` in scopes): nothing to encode, and
        // no `:`, so a layer's part never reads as a scope.
        if !key.in_default_layer() {
            out.extend_from_slice(key.layer().as_bytes());
            out.push(b':');
        }
        out.extend_from_slice(scope.as_bytes());
        out
    }
}

/// `bytes` percent-encoded but for ASCII letters, digits and `-_.:@`: one name per key, and
/// never a brace, which would move the hash tag.
fn push_encoded(out: &mut Vec<u8>, bytes: &[u8]) {
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-_.:@".contains(&b) {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
        }
    }
}

/// `bytes`' SipHash-2-4 under `secret`, 128 bits as 32 hex digits: a keyed hash stable
/// across processes, versions and machines, as every host must name a key alike.
fn push_hashed(out: &mut Vec<u8>, secret: &[u8; 16], bytes: &[u8]) {
    let mut hasher = SipHasher24::new_with_key(secret);
    hasher.write(bytes);
    for b in hasher.finish128().as_bytes() {
        out.extend_from_slice(&[HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
    }
}

/// A throttle key that can name a Redis key: its bytes.
pub trait RedisKey {
    /// The key's bytes; distinct keys must have distinct bytes.
    fn key_bytes(&self) -> Cow<'_, [u8]>;
}

impl RedisKey for String {
    fn key_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.as_bytes())
    }
}

impl RedisKey for &'static str {
    fn key_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.as_bytes())
    }
}

impl RedisKey for crate::key::CompactKey {
    fn key_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.as_bytes())
    }
}

impl RedisKey for Vec<u8> {
    fn key_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self)
    }
}

impl RedisKey for Arc<str> {
    fn key_bytes(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.as_bytes())
    }
}

macro_rules! display_keys {
    ($($t:ty),*) => {$(
        impl RedisKey for $t {
            fn key_bytes(&self) -> Cow<'_, [u8]> {
                Cow::Owned(self.to_string().into_bytes())
            }
        }
    )*};
}

display_keys!(u32, u64, u128, i32, i64, IpAddr);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::CompactKey;

    #[test]
    fn keys_of_the_same_text_name_the_same_redis_key() {
        // So a fleet can move from one key type to another (a `String` key to a compact one)
        // host by host, every host drawing on the same global buckets.
        for text in ["k1", "a-key-longer-than-twenty-two-bytes"] {
            let names = [
                text.to_owned().key_bytes().into_owned(),
                Vec::from(text).key_bytes().into_owned(),
                Arc::<str>::from(text).key_bytes().into_owned(),
                CompactKey::from(text).key_bytes().into_owned(),
            ];
            assert!(names.iter().all(|name| name == text.as_bytes()), "{text}");
        }
    }

    fn store() -> RedisGlobalStore<String> {
        RedisGlobalStore::open("redis://127.0.0.1:1").expect("a valid URL, never connected")
    }

    fn name(store: &RedisGlobalStore<String>, key: &str, limit: &str) -> String {
        let bucket = BucketKey::new(key.to_owned(), limit).expect("a valid name");
        String::from_utf8(store.redis_key(&bucket)).expect("ASCII")
    }

    /// The part between the braces: the cluster's hash tag.
    fn tag(name: &str) -> &str {
        let open = name.find('{').expect("a tag");
        &name[open + 1..name.find('}').expect("a tag")]
    }

    #[test]
    fn hashed_keys_are_named_by_the_published_siphash_of_their_bytes() {
        // SipHash-2-4-128 of the empty message under the key 00 01 .. 0f: the reference
        // implementation's first test vector, so every host, version and port names alike.
        let secret: [u8; 16] = std::array::from_fn(|i| i as u8);
        let store = store().with_hashed_keys(secret);
        assert_eq!(
            name(&store, "", "per-second"),
            "throttle:{A3817F04BA25A8E66DF67214C7550293}:per-second"
        );
    }

    #[test]
    fn hashed_keys_never_show_the_key_and_keep_one_tag_per_key() {
        let hashed = store().with_hashed_keys([7; 16]);
        let other_secret = store().with_hashed_keys([8; 16]);
        let secret_key = "sk_live_0123456789abcdef-a-long-api-key-of-many-bytes";
        let per_second = name(&hashed, secret_key, "per-second");
        assert!(!per_second.contains("sk_live"), "{per_second}");
        assert_eq!(tag(&per_second).len(), 32);
        assert!(tag(&per_second).bytes().all(|b| b.is_ascii_hexdigit()));
        // All of a key's buckets on one cluster slot; the same name on every host.
        assert_eq!(tag(&per_second), tag(&name(&hashed, secret_key, "per-day")));
        assert_eq!(
            per_second,
            name(&store().with_hashed_keys([7; 16]), secret_key, "per-second")
        );
        // Other keys, and the same key under another secret, elsewhere.
        assert_ne!(
            tag(&per_second),
            tag(&name(&hashed, "sk_live_0", "per-second"))
        );
        assert_ne!(per_second, name(&other_secret, secret_key, "per-second"));
        // Written out without a secret, as before.
        assert_eq!(
            name(&store(), "k 1", "per-second"),
            "throttle:{k%201}:per-second"
        );
        // Debug output says whether keys are hashed, never with what.
        let debug = format!("{hashed:?}");
        assert!(
            debug.contains("hashed_keys: true") && !debug.contains("[7, 7"),
            "{debug}"
        );
    }
}
