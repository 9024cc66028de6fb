//! How the `RateLimit-Policy` and `RateLimit` fields describe a layer's limits: which revision
//! of the IETF draft they follow, the quota unit of each limit, and whether items carry a
//! partition key. Set with [`Builder::ratelimit_fields`](crate::Builder::ratelimit_fields);
//! the engine stamps every [`Remaining`](crate::Remaining) and
//! [`Rejection`](crate::Rejection) with what applies to it, the answers write it out.

use std::fmt;
use std::hash::{Hash, Hasher};

use crate::error::ConfigError;
use crate::quota::Name;

/// The revision of `draft-ietf-httpapi-ratelimit-headers` the fields follow. A new revision
/// that changes what a parameter means becomes a new variant, so that a service moves to it
/// by choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Revision {
    /// Revision 11 (May 2026): `r` is the quota available within the effective window `t`.
    #[default]
    Draft11,
}

/// What admitted responses say of their limits, in the `RateLimit-Policy` and `RateLimit`
/// fields: off, or on after a [`Revision`] of the draft, with quota units and partition keys.
///
/// ```
/// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, RateLimitFields};
///
/// let fields = RateLimitFields::draft_11()
///     .unit("content-bytes")
///     .partition_keys(*b"shared by hosts!");
/// let layer = HierarchicalThrottleLayer::builder()
///     .key(|req: &http::Request<()>| Some(req.uri().path().to_owned()))
///     .limit(Limit::per_second(1_000_000).build()?)
///     .cost(|req: &http::Request<()>| req.headers().len() as u64)
///     .ratelimit_fields(fields)
///     .global_store(MemoryGlobalStore::new())
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), hierarchical_throttle::ConfigError>(())
/// ```
///
/// `From<bool>`: `true` is [`draft_11`](Self::draft_11), `false` is [`off`](Self::off).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitFields {
    revision: Option<Revision>,
    unit: Option<Name>,
    units: Vec<(Option<Name>, Name, Name)>,
    partition_secret: Option<[u8; 16]>,
    error: Option<ConfigError>,
}

impl Default for RateLimitFields {
    /// [`draft_11`](Self::draft_11).
    fn default() -> Self {
        Self::draft_11()
    }
}

impl From<bool> for RateLimitFields {
    fn from(on: bool) -> Self {
        match on {
            true => Self::draft_11(),
            false => Self::off(),
        }
    }
}

/// The unit of a layer whose requests each cost one token.
pub const REQUESTS: &str = "requests";
/// The unit of a concurrency limit: requests in flight
/// ([`HierarchicalConcurrencyLayer`](crate::HierarchicalConcurrencyLayer)).
pub const CONCURRENT_REQUESTS: &str = "concurrent-requests";
/// The unit of a layer with other costs ([`Builder::cost`](crate::Builder::cost), settled
/// costs), unless one is named.
pub const TOKENS: &str = "tokens";

impl RateLimitFields {
    /// No fields on admitted responses (refusals still name their refusing limit, in the
    /// default revision): for clients that do not read them, saving the cost of reading each
    /// limit's state and writing two fields per response.
    pub fn off() -> Self {
        Self {
            revision: None,
            ..Self::draft_11()
        }
    }

    /// Fields after revision 11 of the draft (the default). See the README's table for what
    /// each parameter says of a token bucket.
    pub fn draft_11() -> Self {
        Self::revision(Revision::Draft11)
    }

    /// Fields after `revision` of the draft.
    pub fn revision(revision: Revision) -> Self {
        Self {
            revision: Some(revision),
            unit: None,
            units: Vec::new(),
            partition_secret: None,
            error: None,
        }
    }

    /// The quota unit (`qu`) of every limit not given one by [`unit_of`](Self::unit_of):
    /// `"content-bytes"`, `"concurrent-requests"` or a unit of your own (1 to 64 ASCII
    /// letters, digits, `-`, `_` or `.`). Default: `"requests"` when every request costs one
    /// token, `"tokens"` when the layer has a [`cost`](crate::Builder::cost) or settles costs.
    pub fn unit(mut self, unit: &str) -> Self {
        match unit_name(unit) {
            Ok(unit) => self.unit = Some(unit),
            Err(error) => self.fail(error),
        }
        self
    }

    /// The quota unit of one limit, named as the fields name it within the layer:
    /// `"per-day"`, or `"tenant/per-day"` for a limit of level `tenant` (`"tenant/default"`
    /// for a level's lone limit). A name that is not one of the layer's limits (when its
    /// quotas are fixed) is an error when the layer is built.
    pub fn unit_of(mut self, limit: &str, unit: &str) -> Self {
        let scope = match limit.split_once('/') {
            Some((level, limit)) => Name::new(level)
                .map(Some)
                .and_then(|level| Name::new(limit).map(|limit| (level, limit))),
            None => Name::new(limit).map(|limit| (None, limit)),
        };
        match (scope, unit_name(unit)) {
            (Ok((level, limit)), Ok(unit)) => self.units.push((level, limit, unit)),
            (Err(error), _) | (_, Err(error)) => self.fail(error),
        }
        self
    }

    /// Items carry a partition key (`pk`): a keyed hash of the layer, the level and the
    /// request's key at that level, truncated to 8 bytes, so that a client holding several
    /// keys, or reading a tenant's item and a user's, can tell them apart; never the key
    /// itself. Give every host of a fleet the same `secret`, so that a client sees one
    /// partition key whichever host answers; keep it secret, or clients could test guesses of
    /// other keys. Stable across hosts running the same build.
    pub fn partition_keys(mut self, secret: [u8; 16]) -> Self {
        self.partition_secret = Some(secret);
        self
    }

    fn fail(&mut self, error: ConfigError) {
        self.error.get_or_insert(error);
    }

    /// The first invalid setting, reported by the builder.
    pub(crate) fn error(&self) -> Option<&ConfigError> {
        self.error.as_ref()
    }

    /// The limits given a unit of their own, by level and name.
    pub(crate) fn named_limits(&self) -> impl Iterator<Item = (Option<Name>, Option<Name>)> + '_ {
        self.units
            .iter()
            .map(|&(level, limit, _)| (level, Some(limit)))
    }

    /// Whether admitted responses get fields.
    pub(crate) fn on(&self) -> bool {
        self.revision.is_some()
    }

    /// The unit of limit `limit` at `level`, on a layer whose costs vary or not. Compared as
    /// text: a request's answer looks it up without interning anything (a lock).
    pub(crate) fn unit_of_limit(
        &self,
        level: Option<&str>,
        limit: &str,
        costs_vary: bool,
    ) -> &'static str {
        let named = self
            .units
            .iter()
            .find(|&&(l, n, _)| l.map(Name::as_str) == level && n.as_str() == limit)
            .map(|&(_, _, unit)| unit)
            .or(self.unit);
        match (named, costs_vary) {
            (Some(unit), _) => unit.as_str(),
            (None, false) => REQUESTS,
            (None, true) => TOKENS,
        }
    }

    /// Whether the fields carry partition keys.
    pub(crate) fn has_partition_keys(&self) -> bool {
        self.partition_secret.is_some()
    }

    /// The partition key of `key` at `level` of `layer`, when they are on.
    pub(crate) fn partition_key<K: Hash>(
        &self,
        layer: &str,
        level: Option<&str>,
        key: &K,
    ) -> Option<PartitionKey> {
        let secret = self.partition_secret.as_ref()?;
        let mut hasher = siphasher::sip::SipHasher24::new_with_key(secret);
        layer.hash(&mut hasher);
        level.hash(&mut hasher);
        key.hash(&mut hasher);
        Some(PartitionKey(hasher.finish().to_be_bytes()))
    }
}

fn unit_name(unit: &str) -> Result<Name, ConfigError> {
    Name::new(unit).map_err(|_| ConfigError::Unreadable {
        part: unit.to_owned(),
        expected: "a quota unit of 1 to 64 ASCII letters, digits, `-`, `_` or `.` \
                   (`requests`, `content-bytes`, `concurrent-requests`, or your own)",
    })
}

/// A partition key: 8 bytes of a keyed hash of a layer, a level and a key. Printed as a
/// Structured Field byte sequence, `:AAECAwQFBgc=:`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PartitionKey([u8; 8]);

impl PartitionKey {
    #[cfg(test)]
    pub(crate) fn test(bytes: [u8; 8]) -> Self {
        Self(bytes)
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8; 8] {
        &self.0
    }
}

impl fmt::Display for PartitionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = [b'='; 14];
        out[0] = b':';
        out[13] = b':';
        // 8 bytes: two groups of three, then two bytes padded with one `=`.
        let bytes = self.0;
        for (group, chunk) in bytes.chunks(3).enumerate() {
            let n = chunk
                .iter()
                .enumerate()
                .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
            let digits = chunk.len() + 1;
            for d in 0..digits {
                let index = (n >> (18 - 6 * d)) & 63;
                out[1 + 4 * group + d] = ALPHABET[index as usize];
            }
        }
        // Always ASCII.
        f.write_str(std::str::from_utf8(&out).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_keys_print_as_byte_sequences() {
        let key = PartitionKey([0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(key.to_string(), ":AAECAwQFBgc=:");
        let key = PartitionKey([255; 8]);
        assert_eq!(key.to_string(), "://////////8=:");
    }

    #[test]
    fn partition_keys_depend_on_secret_layer_level_and_key() {
        let fields = RateLimitFields::draft_11().partition_keys([7; 16]);
        let layer = "api";
        let tenant = Some("tenant");
        let pk = |fields: &RateLimitFields, layer, level, key: &str| {
            fields.partition_key(layer, level, &key).unwrap()
        };
        let base = pk(&fields, layer, None, "alice");
        assert_eq!(base, pk(&fields, layer, None, "alice"));
        assert_ne!(base, pk(&fields, layer, None, "bob"));
        assert_ne!(base, pk(&fields, layer, tenant, "alice"));
        assert_ne!(base, pk(&fields, "other", None, "alice"));
        let other_secret = RateLimitFields::draft_11().partition_keys([8; 16]);
        assert_ne!(base, pk(&other_secret, layer, None, "alice"));
        assert!(
            RateLimitFields::draft_11()
                .partition_key(layer, None, &"alice")
                .is_none()
        );
    }

    #[test]
    fn units_are_found_per_limit_then_for_the_layer_then_by_cost() {
        let per_day = "per-day";
        let tenant = Some("tenant");
        let plain = RateLimitFields::draft_11();
        assert_eq!(plain.unit_of_limit(None, per_day, false), "requests");
        assert_eq!(plain.unit_of_limit(None, per_day, true), "tokens");
        let named = plain
            .unit("content-bytes")
            .unit_of("tenant/per-day", "llm-tokens");
        assert_eq!(named.unit_of_limit(tenant, per_day, true), "llm-tokens");
        assert_eq!(named.unit_of_limit(None, per_day, false), "content-bytes");
        assert!(named.error().is_none());
        let bad = RateLimitFields::draft_11().unit("tokens \"quoted\"");
        assert!(bad.error().unwrap().to_string().contains("quota unit"));
        let bad = RateLimitFields::draft_11().unit_of("a/b/c", "requests");
        assert!(bad.error().is_some());
    }
}
