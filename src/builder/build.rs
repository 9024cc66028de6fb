//! The layer made from the builder's settings: levels, the store's registration, the engine
//! and the request policy.

use std::hash::Hash;
use std::sync::Arc;

use crate::clock::Clock;
use crate::error::ConfigError;
use crate::global::GlobalStore;
use crate::layer::HierarchicalThrottleLayer;
use crate::local::LocalStore;
use crate::policy::RequestPolicy;
use crate::quota::{BucketKey, LeaseKey, Name};
use crate::throttle::{Level, QuotaSource, Throttle};

use super::{Builder, QuotaSetting};

impl<Req, K, G, L, C, R> Builder<Req, K, G, L, C, R>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    /// The layer, or the first invalid setting.
    pub fn build(self) -> Result<HierarchicalThrottleLayer<Req, K, G, L, C, R>, ConfigError> {
        if let Some(error) = self.error {
            return Err(error);
        }
        let first = match self.quota {
            Some(QuotaSetting::PerKey(per_key)) => QuotaSource::PerKey(per_key),
            Some(QuotaSetting::Fixed(quota)) => QuotaSource::Fixed(quota),
            None => {
                return Err(ConfigError::InvalidSetting {
                    setting: "limit",
                    expected: "a limit: call .limit(), .quota() or .limit_per_key()",
                });
            }
        };
        let mut levels = vec![Level {
            name: None,
            quota: first,
        }];
        let mut level_keys = Vec::with_capacity(self.levels.len());
        for level in self.levels {
            levels.push(Level {
                name: Some(level.name),
                quota: level.quota,
            });
            level_keys.push(level.key);
        }
        check_named_limits(
            self.config.shadow_limits.iter().copied(),
            &levels,
            "a limit of the layer (`per-day`, or `tenant/per-day` at a further level), or \
             a level of it, for a limit in shadow",
        )?;
        check_named_limits(
            self.config.fields.named_limits(),
            &levels,
            "a limit of the layer (`per-day`, or `tenant/per-day` at a further level), for \
             a limit's unit in the RateLimit fields",
        )?;
        let registration = match self.global.layers() {
            Some(registry) => Some(
                registry
                    .register(self.config.layer.as_str(), limits_fingerprint(&levels))
                    .ok_or(ConfigError::InvalidSetting {
                        setting: "name",
                        expected: "a layer name that no other live layer on this global store \
                                   uses with other limits (their buckets would collide): give \
                                   each layer its own .name()",
                    })?,
            ),
            None => None,
        };
        let mut throttle = Throttle::new(
            self.global,
            self.local,
            self.clock,
            levels.into_boxed_slice(),
            self.batch,
            self.config,
        );
        throttle.registration = registration;
        let policy = RequestPolicy {
            key: self.key,
            levels: level_keys.into_boxed_slice(),
            cost: self.cost,
            exempt: self.exempt,
            missing_key: self.missing_key,
            on_rejection: self.on_rejection,
            one_limit: throttle.one_limit_template(),
        };
        Ok(HierarchicalThrottleLayer {
            throttle: Arc::new(throttle),
            policy: Arc::new(policy),
        })
    }
}

/// What tells a layer's limits apart from another's of the same name on one store: each
/// level's name and its quota (or that it is chosen per key).
fn limits_fingerprint<K>(levels: &[Level<K>]) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = foldhash::fast::FixedState::with_seed(0).build_hasher();
    for level in levels {
        level.name.map(Name::as_str).hash(&mut hasher);
        match &level.quota {
            QuotaSource::Fixed(quota) => {
                let mut limits: Vec<_> = quota.iter().collect();
                limits.sort_unstable_by_key(|&(name, _)| name);
                limits.hash(&mut hasher);
            }
            QuotaSource::PerKey(_) => "per key".hash(&mut hasher),
        }
    }
    hasher.finish()
}

/// Every limit named by a setting (`purpose`: a limit in shadow, a limit's unit) is a level
/// of the layer (`None`: its first), and a limit of it (`None`: every one) when its quota is
/// fixed.
fn check_named_limits<K>(
    named: impl IntoIterator<Item = (Option<Name>, Option<Name>)>,
    levels: &[Level<K>],
    purpose: &'static str,
) -> Result<(), ConfigError> {
    for (level, limit) in named {
        let Some(found) = levels.iter().find(|l| l.name == level) else {
            return Err(ConfigError::Unreadable {
                part: level.map_or("", Name::as_str).to_owned(),
                expected: purpose,
            });
        };
        let known = match (&found.quota, limit) {
            (QuotaSource::Fixed(quota), Some(limit)) => quota.get(limit.as_str()).is_some(),
            _ => true,
        };
        if !known {
            return Err(ConfigError::Unreadable {
                part: limit.map_or("", Name::as_str).to_owned(),
                expected: purpose,
            });
        }
    }
    Ok(())
}
