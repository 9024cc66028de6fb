//! Quotas: the named limits a key draws on, and the identities of their buckets.
//!
//! A [`Quota`] is a set of named [`Limit`]s, such as `per-second: 100/s burst 200` and
//! `per-day: 100000/day`. Every limit is a bucket of its own, leased in batches from its own
//! global bucket, and a request is admitted only when every bucket it draws on has its cost.
//! A layer has one level of keys by default ([`Builder::key`](crate::Builder::key)) and may
//! add more ([`Builder::level`](crate::Builder::level)): a user, its tenant, a route.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::ConfigError;
use crate::limit::Limit;
use crate::sync::lock;

/// The most limits one quota holds.
pub const MAX_LIMITS: usize = 16;

/// The name a limit gets when it is given without one ([`Builder::limit`](crate::Builder::limit),
/// `From<Limit>`).
pub const DEFAULT_NAME: &str = "default";

/// A set of named limits, all of which a request must satisfy.
///
/// Cloning is cheap (the limits are shared), so tiers are best built once and cloned:
///
/// ```
/// use hierarchical_throttle::{Limit, Quota};
///
/// let quota = Quota::new("per-second", Limit::per_second(100).burst(200)?)?
///     .and("per-day", Limit::per_day(100_000).build()?)?;
/// assert_eq!(quota.len(), 2);
///
/// // The same, as a configuration file would write it.
/// let read: Quota = "per-second: 100/s burst 200; per-day: 100000/day".parse()?;
/// assert_eq!(read, quota);
/// assert_eq!(read.to_string(), "per-second: 100/s burst 200; per-day: 100000/day");
/// # Ok::<(), hierarchical_throttle::ConfigError>(())
/// ```
///
/// Names are 1 to 64 ASCII letters, digits, `-`, `_` or `.`, distinct within a quota; they name
/// the limit in `RateLimit-Policy`, in rejections, in metrics and in the global store's keys.
/// A quota holds 1 to [`MAX_LIMITS`] limits.
#[derive(Clone)]
pub struct Quota {
    limits: Arc<[(Name, Limit)]>,
}

impl Quota {
    /// A quota of one limit called `name`.
    pub fn new(name: &str, limit: Limit) -> Result<Self, ConfigError> {
        Ok(Self {
            limits: Arc::from([(Name::new(name)?, limit)]),
        })
    }

    /// This quota and one more limit called `name`.
    pub fn and(self, name: &str, limit: Limit) -> Result<Self, ConfigError> {
        let name = Name::new(name)?;
        if self.limits.iter().any(|(n, _)| *n == name) {
            return Err(invalid("Quota::and", "limit names distinct within a quota"));
        }
        if self.limits.len() >= MAX_LIMITS {
            return Err(invalid("Quota::and", "at most 16 limits in a quota"));
        }
        let mut limits = self.limits.to_vec();
        limits.push((name, limit));
        Ok(Self {
            limits: Arc::from(limits),
        })
    }

    /// Number of limits.
    #[allow(clippy::len_without_is_empty)] // A quota is never empty.
    pub fn len(&self) -> usize {
        self.limits.len()
    }

    /// The limits and their names, in the order they were given.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &Limit)> {
        self.limits
            .iter()
            .map(|(name, limit)| (name.as_str(), limit))
    }

    /// The limit called `name`.
    pub fn get(&self, name: &str) -> Option<&Limit> {
        self.iter().find(|(n, _)| *n == name).map(|(_, l)| l)
    }

    pub(crate) fn slot(&self, slot: u8) -> Option<(Name, Limit)> {
        self.limits.get(usize::from(slot)).copied()
    }

    /// The limits with their interned names, in slot order.
    pub(crate) fn slots_iter(&self) -> impl Iterator<Item = (Name, Limit)> + '_ {
        self.limits.iter().copied()
    }

    /// Number of limits, as a bucket slot count.
    pub(crate) fn slots(&self) -> u8 {
        // At most MAX_LIMITS: always fits.
        u8::try_from(self.limits.len()).unwrap_or(u8::MAX)
    }
}

impl PartialEq for Quota {
    /// The same named limits, in any order (a configuration file's table may list them in
    /// another order than a string).
    fn eq(&self, other: &Self) -> bool {
        self.limits.len() == other.limits.len()
            && self.limits.iter().all(|mine| other.limits.contains(mine))
    }
}

impl Eq for Quota {}

impl From<Limit> for Quota {
    /// A quota of one limit called [`DEFAULT_NAME`].
    fn from(limit: Limit) -> Self {
        Self {
            limits: Arc::from([(Name::intern(DEFAULT_NAME), limit)]),
        }
    }
}

impl fmt::Debug for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(n, l)| (n, l.to_string())))
            .finish()
    }
}

impl fmt::Display for Quota {
    /// `per-second: 100/s burst 200; per-day: 100000/day`; it reads back as the same quota.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, limit)) in self.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{name}: {limit}")?;
        }
        Ok(())
    }
}

impl FromStr for Quota {
    type Err = ConfigError;

    /// `name: limit` pairs separated by `;`, each limit as [`Limit`] reads it; a lone limit
    /// without a name is called [`DEFAULT_NAME`]. Errors name the part that could not be read,
    /// and say what was meant where it is plain: several limits without names, limits
    /// separated by `,`, a level's name written before a limit's.
    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let parts: Vec<&str> = text
            .split(';')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .collect();
        let mut pairs = Vec::with_capacity(parts.len());
        for part in &parts {
            // A calendar quota's reset time has a `:` of its own (`100000 per day at 00:00
            // UTC`); a name never holds ` at `.
            let named = match part.split_once(':') {
                Some((name, _)) if name.contains(" at ") => None,
                split => split,
            };
            pairs.push(match named {
                Some((name, limit)) => (name.trim(), read_limit_part(limit)?),
                None if parts.len() > 1 => {
                    return Err(ConfigError::Unreadable {
                        part: (*part).to_owned(),
                        expected: "a name for each limit of a quota of several \
                                   (`per-second: 100/s; per-day: 100000/day`)",
                    });
                }
                None => (DEFAULT_NAME, read_limit_part(part)?),
            });
        }
        Quota::from_written(pairs)?.ok_or_else(|| ConfigError::Unreadable {
            part: text.to_owned(),
            expected: "at least one `name: limit`",
        })
    }
}

/// A limit as written in a quota, refused with what was meant when it holds the next limit
/// after a `,` (limits are separated by `;`; a `,` groups digits).
fn read_limit_part(text: &str) -> Result<&str, ConfigError> {
    match text.split_once(',') {
        Some((_, rest)) if rest.contains(':') => Err(ConfigError::Unreadable {
            part: text.trim().to_owned(),
            expected: "limits separated by `;`, not `,`",
        }),
        _ => Ok(text),
    }
}

impl Quota {
    /// The quota of `(name, limit as text)` pairs, in order; `None` when there are none.
    fn from_written<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Option<Self>, ConfigError> {
        pairs
            .into_iter()
            .try_fold(None, |quota: Option<Quota>, (name, limit)| {
                let limit: Limit = limit.parse()?;
                Ok(Some(match quota {
                    None => Quota::new(name, limit)?,
                    Some(quota) => quota.and(name, limit)?,
                }))
            })
    }
}

#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
impl<'de> serde::Deserialize<'de> for Quota {
    /// From a string (`"per-second: 100/s; per-day: 100000/day"`, or a lone limit) or a map
    /// of names to limit strings (`{ per-second = "100/s", per-day = "100000/day" }`).
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Written {
            Text(String),
            Named(std::collections::BTreeMap<String, String>),
        }
        let quota = match Written::deserialize(deserializer)? {
            Written::Text(text) => text.parse(),
            Written::Named(limits) => {
                let pairs = limits.iter().map(|(n, l)| (n.as_str(), l.as_str()));
                Quota::from_written(pairs)
                    .and_then(|q| q.ok_or_else(|| invalid("quota", "at least one limit")))
            }
        };
        quota.map_err(serde::de::Error::custom)
    }
}

#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
impl serde::Serialize for Quota {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// A limit's name as the `RateLimit` fields show it: the layer's name (when named), the
/// level's and the limit's joined by `/`, leaving a lone limit's `default` out after another
/// name (names hold no `/`, so no two items of distinct layers, levels or limits meet).
pub(crate) fn item_name(
    layer: Option<&'static str>,
    level: Option<&'static str>,
    limit: &'static str,
) -> Cow<'static, str> {
    let limit = (limit != DEFAULT_NAME || (layer.is_none() && level.is_none())).then_some(limit);
    let mut parts = [layer, level, limit].into_iter().flatten();
    let first = parts.next().unwrap_or(DEFAULT_NAME);
    match parts.next() {
        None => Cow::Borrowed(first),
        Some(second) => {
            let mut name = format!("{first}/{second}");
            for part in parts {
                name.push('/');
                name.push_str(part);
            }
            Cow::Owned(name)
        }
    }
}

/// A limit's name as clients and operators see it: `per-second`, or `tenant/per-second` at a
/// further level (names hold no `/`, so the two never meet).
pub(crate) fn scope(level: Option<&'static str>, limit: &'static str) -> Cow<'static, str> {
    match level {
        None => Cow::Borrowed(limit),
        Some(level) => Cow::Owned(format!("{level}/{limit}")),
    }
}

fn invalid(setting: &'static str, expected: &'static str) -> ConfigError {
    ConfigError::InvalidSetting { setting, expected }
}

/// An interned name: copied and compared as a pointer (a thin one, so a bucket key stays
/// small), with a small number of its own for state that keeps it in 4 bytes.
#[derive(Clone, Copy)]
pub(crate) struct Name(&'static Interned);

struct Interned {
    text: String,
    /// From 1, in the order names were first seen in this process.
    id: u32,
}

impl Name {
    /// A valid limit or level name, interned.
    pub(crate) fn new(name: &str) -> Result<Self, ConfigError> {
        if name.contains('/') {
            return Err(ConfigError::Unreadable {
                part: name.to_owned(),
                expected: "a name without `/` (a level and its limits are set with \
                           `Builder::level`, which names them `level/limit` itself)",
            });
        }
        let valid = (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !valid {
            return Err(ConfigError::Unreadable {
                part: name.to_owned(),
                expected: "a name of 1 to 64 ASCII letters, digits, `-`, `_` or `.`",
            });
        }
        Ok(Self::intern(name))
    }

    /// `name` interned. Names are few and live as long as the process.
    pub(crate) fn intern(name: &str) -> Self {
        static NAMES: OnceLock<Mutex<HashMap<&'static str, Name>>> = OnceLock::new();
        let mut names = lock(NAMES.get_or_init(Mutex::default));
        if let Some(&known) = names.get(name) {
            return known;
        }
        let id = u32::try_from(names.len() + 1).unwrap_or(u32::MAX);
        let leaked: &'static Interned = Box::leak(Box::new(Interned {
            text: name.to_owned(),
            id,
        }));
        let interned = Self(leaked);
        names.insert(leaked.text.as_str(), interned);
        interned
    }

    pub(crate) fn as_str(self) -> &'static str {
        &self.0.text
    }

    /// The name's number in this process (never 0).
    pub(crate) fn id(self) -> u32 {
        self.0.id
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for Name {}

impl Hash for Name {
    fn hash<H: Hasher>(&self, state: &mut H) {
        std::ptr::hash(self.0, state);
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The name of a layer not given one ([`Builder::name`](crate::Builder::name)).
pub const DEFAULT_LAYER: &str = "default";

/// A global bucket's identity: the layer's name, a key, the level it was taken at, and the
/// limit's name. What a [`GlobalStore`](crate::global::GlobalStore) keeps one bucket for: layers
/// of other names never share a bucket, even on one store.
///
/// ```
/// use hierarchical_throttle::quota::BucketKey;
/// let k = BucketKey::new("user-1", "per-second")?;
/// assert_eq!((k.key(), k.level(), k.limit()), (&"user-1", None, "per-second"));
/// assert_eq!((k.layer(), k.to_string().as_str()), ("default", "per-second:user-1"));
/// let t = BucketKey::new("acme", "per-day")?.at_level("tenant")?;
/// assert_eq!(t.to_string(), "tenant/per-day:acme");
/// let api = BucketKey::new("user-1", "per-second")?.in_layer("api")?;
/// assert_eq!(api.to_string(), "api:per-second:user-1");
/// # Ok::<(), hierarchical_throttle::ConfigError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct BucketKey<K> {
    key: K,
    layer: Name,
    level: Option<Name>,
    limit: Name,
}

impl<K> BucketKey<K> {
    /// The bucket of `key` for the limit called `limit`, at the first level of the layer
    /// called [`DEFAULT_LAYER`].
    pub fn new(key: K, limit: &str) -> Result<Self, ConfigError> {
        Ok(Self {
            key,
            layer: Name::intern(DEFAULT_LAYER),
            level: None,
            limit: Name::new(limit)?,
        })
    }

    /// The same bucket of the layer called `layer` (see [`Builder::name`](crate::Builder::name)).
    pub fn in_layer(mut self, layer: &str) -> Result<Self, ConfigError> {
        self.layer = Name::new(layer)?;
        Ok(self)
    }

    /// The same bucket at the level called `level` (see
    /// [`Builder::level`](crate::Builder::level)).
    pub fn at_level(mut self, level: &str) -> Result<Self, ConfigError> {
        self.level = Some(Name::new(level)?);
        Ok(self)
    }

    pub(crate) fn from_parts(key: K, layer: Name, level: Option<Name>, limit: Name) -> Self {
        Self {
            key,
            layer,
            level,
            limit,
        }
    }

    /// The layer, level and limit names: which of a key's buckets this is.
    pub(crate) fn names(&self) -> BucketNames {
        (self.layer, self.level, self.limit)
    }

    /// The layer's name ([`DEFAULT_LAYER`] unless the layer was named).
    pub fn layer(&self) -> &'static str {
        self.layer.as_str()
    }

    /// Whether the bucket belongs to the layer called [`DEFAULT_LAYER`].
    pub fn in_default_layer(&self) -> bool {
        self.layer == Name::intern(DEFAULT_LAYER)
    }

    /// The throttle key.
    pub fn key(&self) -> &K {
        &self.key
    }

    /// The level's name; `None` at the layer's first level.
    pub fn level(&self) -> Option<&'static str> {
        self.level.map(Name::as_str)
    }

    /// The limit's name.
    pub fn limit(&self) -> &'static str {
        self.limit.as_str()
    }

    /// What tells this key's buckets apart: `per-second`, or `tenant/per-second` at a
    /// further level. No bucket of another limit or level has the same.
    pub fn scope(&self) -> Cow<'static, str> {
        scope(self.level(), self.limit())
    }
}

impl<K: fmt::Display> fmt::Display for BucketKey<K> {
    /// `<scope>:<key>`, after `<layer>:` for a layer not called [`DEFAULT_LAYER`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.in_default_layer() {
            write!(f, "{}:", self.layer())?;
        }
        write!(f, "{}:{}", self.scope(), self.key)
    }
}

impl<K: fmt::Debug> fmt::Debug for BucketKey<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BucketKey")
            .field("key", &self.key)
            .field("layer", &self.layer)
            .field("level", &self.level)
            .field("limit", &self.limit)
            .finish()
    }
}

/// A global bucket's names: its layer's, its level's (none at the first) and its limit's.
pub(crate) type BucketNames = (Name, Option<Name>, Name);

/// A local bucket's identity on one host: a key, its level's index and the limit's index in
/// the key's quota. Indices, not names, so the hot path needs no quota to find a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseKey<K> {
    pub(crate) key: K,
    pub(crate) level: u8,
    pub(crate) slot: u8,
}

impl<K: Hash> Hash for LeaseKey<K> {
    /// A key's first bucket hashes as the key alone: the common layer (one level, one limit)
    /// pays for no more than its key.
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key.hash(state);
        if self.level != 0 || self.slot != 0 {
            state.write_u16(u16::from(self.level) << 8 | u16::from(self.slot));
        }
    }
}

impl<K> LeaseKey<K> {
    /// The bucket of `key` at level index `level` for the limit at index `slot` of its quota.
    pub fn new(key: K, level: u8, slot: u8) -> Self {
        Self { key, level, slot }
    }

    /// The throttle key.
    pub fn key(&self) -> &K {
        &self.key
    }

    /// The level's index (0: the layer's first level).
    pub fn level(&self) -> u8 {
        self.level
    }

    /// The limit's index in the key's quota.
    pub fn slot(&self) -> u8 {
        self.slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_interned_and_validated() {
        assert_eq!(Name::new("per-day").unwrap(), Name::intern("per-day"));
        assert_ne!(Name::intern("a"), Name::intern("b"));
        for bad in ["", "has space", "col:on", "sl/ash", &"x".repeat(65)] {
            assert!(Name::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn quotas_refuse_duplicate_names_and_too_many_limits() {
        let l = Limit::per_second(1).build().unwrap();
        assert!(Quota::new("a", l).unwrap().and("a", l).is_err());
        let mut q = Quota::new("l0", l).unwrap();
        for i in 1..MAX_LIMITS {
            q = q.and(&format!("l{i}"), l).unwrap();
        }
        assert!(q.and("one-more", l).is_err());
    }

    #[test]
    fn quotas_read_and_print_back() {
        let q: Quota = "100/s".parse().unwrap();
        assert_eq!(q, Quota::from(Limit::per_second(100).build().unwrap()));
        assert_eq!(q.to_string(), "default: 100/s");
        let q: Quota = " a: 1/s burst 5 ;b: 100,000/day ".parse().unwrap();
        assert_eq!(q.to_string().parse::<Quota>().unwrap(), q);
        assert_eq!(q.get("b"), Some(&Limit::per_day(100_000).build().unwrap()));
        let part = |text: &str| match text.parse::<Quota>() {
            Err(ConfigError::Unreadable { part, .. }) => part,
            other => panic!("{text}: {other:?}"),
        };
        assert_eq!(part("a: 1/fortnight"), "fortnight");
        assert_eq!(part("bad name: 1/s"), "bad name");
        assert_eq!(part(" ; "), " ; ");
        // A lone calendar quota's reset time is not a name.
        let daily: Limit = "100000 per day at 09:30 UTC+02:00".parse().unwrap();
        let q: Quota = "100000 per day at 09:30 UTC+02:00".parse().unwrap();
        assert_eq!(q, Quota::from(daily));
        let q: Quota = "daily: 100000 per day at 00:00 UTC; burst: 10/s"
            .parse()
            .unwrap();
        assert_eq!(q.to_string().parse::<Quota>().unwrap(), q);
        assert!(matches!(
            "100000 per day at 25:00 UTC".parse::<Quota>(),
            Err(ConfigError::InvalidSetting {
                setting: "CalendarQuota::resetting_at",
                ..
            })
        ));
        assert_eq!(
            part("a: 10/s; 5 per day at 00:00 UTC"),
            "5 per day at 00:00 UTC"
        );
    }

    #[test]
    fn quotas_are_equal_whatever_the_order_of_their_limits() {
        let a: Quota = "a: 1/s; b: 100,000/day".parse().unwrap();
        let b: Quota = "b: 100000/day; a: 1/s".parse().unwrap();
        assert_eq!(a, b);
        assert_ne!(a, "a: 1/s".parse::<Quota>().unwrap());
        assert_ne!(a, "a: 2/s; b: 100000/day".parse::<Quota>().unwrap());
    }

    #[test]
    fn quota_errors_say_what_was_meant() {
        let refusal = |text: &str| match text.parse::<Quota>() {
            Err(ConfigError::Unreadable { part, expected }) => (part, expected),
            other => panic!("{text}: {other:?}"),
        };
        let (part, expected) = refusal("100/s; 100000/day");
        assert_eq!(part, "100/s");
        assert!(expected.contains("a name for each limit"), "{expected}");
        let (part, expected) = refusal("a: 100/s, b: 1000/day");
        assert_eq!(part, "100/s, b: 1000/day");
        assert!(expected.contains("separated by `;`"), "{expected}");
        let (part, expected) = refusal("tenant/per-second: 100/s");
        assert_eq!(part, "tenant/per-second");
        assert!(expected.contains("Builder::level"), "{expected}");
        // A `,` between digits is still a group separator.
        assert!("a: 100,000/day".parse::<Quota>().is_ok());
    }
}
