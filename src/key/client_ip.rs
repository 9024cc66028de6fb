//! The client's IP address, for a service behind load balancers and other proxies.
//!
//! Behind a load balancer every connection's peer is the balancer, so a limit keyed by the
//! peer address would count the whole world as one client. The client's address is then in a
//! header each proxy appends to (`X-Forwarded-For`, or RFC 7239's `Forwarded`), and only the
//! entries your own proxies added can be believed: anything to their left is whatever the
//! client wrote there. [`ClientIp`] reads the header from the right, past the proxies you
//! trust, and stops at the first address they vouch for.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use http::HeaderMap;
use http::header::{FORWARDED, HeaderName};

use crate::error::ConfigError;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// How a request's client address is found: which proxies are trusted, which header they
/// write, and how addresses are grouped into keys.
///
/// Cloning it is cheap enough for a key closure (the trusted networks are shared).
///
/// ```
/// use std::net::IpAddr;
/// use hierarchical_throttle::key::ClientIp;
///
/// // Two load balancers in 10.0.0.0/8 in front of every host.
/// let client_ip = ClientIp::behind_networks(["10.0.0.0/8"])?;
/// let mut headers = http::HeaderMap::new();
/// // A client that wrote its own entry ("1.1.1.1"); the balancer appended the real one.
/// headers.insert("x-forwarded-for", "1.1.1.1, 203.0.113.7".parse()?);
/// let peer: IpAddr = "10.0.0.5".parse()?;
/// assert_eq!(client_ip.of(peer, &headers), "203.0.113.7".parse::<IpAddr>()?);
///
/// // A client that reaches a host directly is keyed by its own address, whatever it writes.
/// let peer: IpAddr = "198.51.100.9".parse()?;
/// assert_eq!(client_ip.of(peer, &headers), peer);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Addresses are grouped before they become keys: IPv6 by their `/64` network by default (one
/// subscriber's network: a client given a `/64` has more addresses than any limit has keys),
/// IPv4 one by one; [`ipv6_prefix`](Self::ipv6_prefix) and [`ipv4_prefix`](Self::ipv4_prefix)
/// change that. An IPv4 client seen through a dual-stack socket (`::ffff:203.0.113.7`) is keyed
/// as the IPv4 address it is.
#[derive(Debug, Clone)]
pub struct ClientIp {
    proxies: Proxies,
    header: ForwardedHeader,
    ipv4_prefix: u8,
    ipv6_prefix: u8,
}

#[derive(Debug, Clone)]
enum Proxies {
    None,
    Networks(std::sync::Arc<[IpNetwork]>),
    Hops(usize),
}

/// The header the trusted proxies name their clients in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2`: what most load balancers write (the default).
    #[default]
    XForwardedFor,
    /// RFC 7239's `Forwarded: for=client, for=proxy1` (its `for=` parameter; quoted IPv6
    /// addresses and ports are read, obfuscated names such as `_hidden` and `unknown` are not
    /// addresses).
    Forwarded,
    /// `X-Real-IP: client`: one address, set (not appended to) by the nearest proxy, as
    /// nginx's `proxy_set_header X-Real-IP $remote_addr` does.
    XRealIp,
}

impl ForwardedHeader {
    fn name(self) -> &'static HeaderName {
        match self {
            Self::XForwardedFor => &X_FORWARDED_FOR,
            Self::Forwarded => &FORWARDED,
            Self::XRealIp => &X_REAL_IP,
        }
    }

    /// The address an entry of the header names, if it names one.
    fn parse(self, entry: &[u8]) -> Option<IpAddr> {
        let entry = std::str::from_utf8(entry).ok()?.trim();
        match self {
            Self::XForwardedFor | Self::XRealIp => parse_node(entry),
            Self::Forwarded => entry.split(';').find_map(|pair| {
                let (name, value) = pair.split_once('=')?;
                if !name.trim().eq_ignore_ascii_case("for") {
                    return None;
                }
                let value = value.trim();
                let value = value
                    .strip_prefix('"')
                    .and_then(|v| v.strip_suffix('"'))
                    .unwrap_or(value);
                parse_node(value)
            }),
        }
    }
}

/// An address as proxies write it: bare, with a port (`203.0.113.7:4711`), or bracketed IPv6
/// with or without one (`[2001:db8::1]:443`).
fn parse_node(text: &str) -> Option<IpAddr> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(socket) = text.parse::<std::net::SocketAddr>() {
        return Some(socket.ip());
    }
    let inner = text.strip_prefix('[')?.strip_suffix(']')?;
    inner.parse::<Ipv6Addr>().ok().map(IpAddr::V6)
}

impl ClientIp {
    /// No proxy in front: the connection's peer is the client, and forwarding headers are
    /// ignored (a client could write anything there).
    pub fn direct() -> Self {
        Self::with(Proxies::None)
    }

    /// Behind proxies whose addresses lie in `networks` (`"10.0.0.0/8"`, `"fd00::/8"`; a bare
    /// address is a network of one). The client is the first address, from the right, that is
    /// not a trusted proxy's: the peer itself when it is not trusted (the request did not come
    /// through your proxies, so its header proves nothing). When every address is trusted, the
    /// farthest is the client (a request from inside your network).
    ///
    /// An entry that names no address (`unknown`, garbage) ends the walk at the trusted proxy
    /// that passed it on: the request is keyed by that proxy rather than by a name its sender
    /// chose.
    ///
    /// # Errors
    ///
    /// A network that cannot be read, or no network at all ([`direct`](Self::direct) is the
    /// setting for no proxy).
    pub fn behind_networks<I>(networks: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let networks = networks
            .into_iter()
            .map(|text| text.as_ref().parse())
            .collect::<Result<Vec<IpNetwork>, _>>()?;
        if networks.is_empty() {
            return Err(ConfigError::InvalidSetting {
                setting: "ClientIp::behind_networks",
                expected: "at least one network (ClientIp::direct for none)",
            });
        }
        Ok(Self::with(Proxies::Networks(networks.into())))
    }

    /// Behind exactly `hops` proxies on every request's way (a load balancer alone is one),
    /// where their addresses are not known in advance: the client is the address the farthest
    /// of them received the request from, `hops` entries from the right of the header counting
    /// the peer. A request with fewer entries is keyed by the leftmost it has.
    ///
    /// Prefer [`behind_networks`](Self::behind_networks) when you can: with hops, a client that
    /// reaches a host without passing through all of the proxies chooses its own key.
    ///
    /// # Errors
    ///
    /// Zero hops ([`direct`](Self::direct) is the setting for no proxy).
    pub fn behind_hops(hops: usize) -> Result<Self, ConfigError> {
        if hops == 0 {
            return Err(ConfigError::InvalidSetting {
                setting: "ClientIp::behind_hops",
                expected: "at least one hop (ClientIp::direct for none)",
            });
        }
        Ok(Self::with(Proxies::Hops(hops)))
    }

    fn with(proxies: Proxies) -> Self {
        Self {
            proxies,
            header: ForwardedHeader::default(),
            ipv4_prefix: 32,
            ipv6_prefix: 64,
        }
    }

    /// The header the proxies write (`X-Forwarded-For` by default). Only that one is read: a
    /// client could write the other, which your proxies pass on untouched.
    pub fn header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Groups IPv6 clients by their network of this many leading bits (64 by default; 128
    /// keys each address on its own).
    ///
    /// # Errors
    ///
    /// A prefix above 128.
    pub fn ipv6_prefix(mut self, bits: u8) -> Result<Self, ConfigError> {
        if bits > 128 {
            return Err(ConfigError::InvalidSetting {
                setting: "ClientIp::ipv6_prefix",
                expected: "at most 128 bits",
            });
        }
        self.ipv6_prefix = bits;
        Ok(self)
    }

    /// Groups IPv4 clients by their network of this many leading bits (32 by default: each
    /// address on its own).
    ///
    /// # Errors
    ///
    /// A prefix above 32.
    pub fn ipv4_prefix(mut self, bits: u8) -> Result<Self, ConfigError> {
        if bits > 32 {
            return Err(ConfigError::InvalidSetting {
                setting: "ClientIp::ipv4_prefix",
                expected: "at most 32 bits",
            });
        }
        self.ipv4_prefix = bits;
        Ok(self)
    }

    /// The client's key: its address (grouped, see the type's docs) for a request received
    /// from `peer` with `headers`.
    pub fn of(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = peer.to_canonical();
        let client = match &self.proxies {
            Proxies::None => peer,
            Proxies::Networks(networks) => self.past_trusted(peer, headers, networks),
            Proxies::Hops(hops) => self.past_hops(peer, headers, *hops),
        };
        self.group(client)
    }

    /// The client's key for a request, what a key closure returns: its peer read from axum's
    /// `ConnectInfo<SocketAddr>` (feature `axum`; see [`axum_peer_ip`](super::axum_peer_ip)),
    /// tonic's `TcpConnectInfo` (feature `tonic`), or a `SocketAddr` in the request's
    /// extensions (which a server of your own can put there). `None` when the request carries
    /// no peer address: the layer's [`MissingKey`](super::MissingKey) policy decides.
    pub fn key<B>(&self, request: &http::Request<B>) -> Option<IpAddr> {
        Some(self.of(peer_of(request)?, request.headers()))
    }

    /// The header's addresses, nearest proxy first (`None` for an entry naming none): its
    /// lines from the last, each line's entries from the right.
    fn entries<'h>(&self, headers: &'h HeaderMap) -> impl Iterator<Item = Option<IpAddr>> + 'h {
        let header = self.header;
        headers
            .get_all(header.name())
            .iter()
            .rev()
            .flat_map(|line| line.as_bytes().rsplit(|b| *b == b','))
            .map(move |entry| header.parse(entry).map(|ip| ip.to_canonical()))
    }

    fn past_trusted(&self, peer: IpAddr, headers: &HeaderMap, networks: &[IpNetwork]) -> IpAddr {
        let trusted = |ip: IpAddr| networks.iter().any(|n| n.contains(ip));
        let mut nearest = peer;
        if !trusted(peer) {
            return peer;
        }
        for entry in self.entries(headers) {
            match entry {
                Some(ip) if trusted(ip) => nearest = ip,
                Some(ip) => return ip,
                None => return nearest,
            }
        }
        nearest
    }

    fn past_hops(&self, peer: IpAddr, headers: &HeaderMap, hops: usize) -> IpAddr {
        let mut farthest = peer;
        for (passed, entry) in (1..).zip(self.entries(headers)) {
            let Some(ip) = entry else {
                return farthest;
            };
            farthest = ip;
            if passed == hops {
                break;
            }
        }
        farthest
    }

    fn group(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from_bits(
                v4.to_bits() & mask_u32(self.ipv4_prefix),
            )),
            IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from_bits(
                v6.to_bits() & mask_u128(self.ipv6_prefix),
            )),
        }
    }
}

fn peer_of<B>(request: &http::Request<B>) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(ip) = super::axum_connect_info_ip(request) {
        return Some(ip);
    }
    #[cfg(feature = "tonic")]
    if let Some(ip) = super::tonic_peer_ip(request) {
        return Some(ip);
    }
    if let Some(peer) = request.extensions().get::<std::net::SocketAddr>() {
        return Some(peer.ip());
    }
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    super::warn_once(
        &WARNED,
        "key::ClientIp found no peer address: serve an axum app with \
         into_make_service_with_connect_info::<SocketAddr>(), a tonic one with its Server, \
         or put the peer's SocketAddr in the request's extensions",
    );
    None
}

fn mask_u32(bits: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0)
}

fn mask_u128(bits: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0)
}

/// A network of IP addresses: `10.0.0.0/8`, `fd00::/8`, or a bare address (a network of one).
///
/// ```
/// use hierarchical_throttle::key::IpNetwork;
/// let network: IpNetwork = "10.0.0.0/8".parse()?;
/// assert!(network.contains("10.1.2.3".parse()?));
/// assert!(!network.contains("11.0.0.1".parse()?));
/// assert!("10.0.0.0/33".parse::<IpNetwork>().is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpNetwork {
    first: IpAddr,
    prefix: u8,
}

impl IpNetwork {
    /// The network of `address`'s first `prefix` bits (its other bits are ignored). An
    /// IPv4-mapped IPv6 network (`::ffff:10.0.0.0/104`) is the IPv4 network it maps.
    ///
    /// # Errors
    ///
    /// A prefix longer than the address (32 bits for IPv4, 128 for IPv6).
    pub fn new(address: IpAddr, prefix: u8) -> Result<Self, ConfigError> {
        let (address, prefix) = match address {
            IpAddr::V6(v6) if prefix >= 96 && v6.to_ipv4_mapped().is_some() => {
                (address.to_canonical(), prefix - 96)
            }
            _ => (address, prefix),
        };
        let first = match address {
            IpAddr::V4(v4) if prefix <= 32 => {
                IpAddr::V4(Ipv4Addr::from_bits(v4.to_bits() & mask_u32(prefix)))
            }
            IpAddr::V6(v6) if prefix <= 128 => {
                IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & mask_u128(prefix)))
            }
            _ => {
                return Err(ConfigError::InvalidSetting {
                    setting: "IpNetwork",
                    expected: "a prefix of at most 32 bits for IPv4, 128 for IPv6",
                });
            }
        };
        Ok(Self { first, prefix })
    }

    /// Whether `address` is in the network (an IPv4-mapped IPv6 address as its IPv4 one).
    pub fn contains(&self, address: IpAddr) -> bool {
        match (self.first, address.to_canonical()) {
            (IpAddr::V4(first), IpAddr::V4(ip)) => {
                ip.to_bits() & mask_u32(self.prefix) == first.to_bits()
            }
            (IpAddr::V6(first), IpAddr::V6(ip)) => {
                ip.to_bits() & mask_u128(self.prefix) == first.to_bits()
            }
            _ => false,
        }
    }
}

impl FromStr for IpNetwork {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let unreadable = || ConfigError::Unreadable {
            part: text.to_owned(),
            expected: "an IP network such as 10.0.0.0/8 or fd00::/8, or an address",
        };
        let (address, prefix) = match text.trim().split_once('/') {
            Some((address, prefix)) => {
                let prefix = prefix.trim().parse::<u8>().map_err(|_| unreadable())?;
                (address.trim(), Some(prefix))
            }
            None => (text.trim(), None),
        };
        let address = address.parse::<IpAddr>().map_err(|_| unreadable())?;
        let prefix = prefix.unwrap_or(match address {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        });
        Self::new(address, prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn headers(name: &str, lines: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for line in lines {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                line.parse().unwrap(),
            );
        }
        headers
    }

    fn xff(lines: &[&str]) -> HeaderMap {
        headers("x-forwarded-for", lines)
    }

    fn behind_lb() -> ClientIp {
        ClientIp::behind_networks(["10.0.0.0/8", "fd00::/8"]).unwrap()
    }

    #[test]
    fn direct_clients_are_their_peer_whatever_they_write() {
        let spoofed = xff(&["203.0.113.7"]);
        let peer = ip("198.51.100.9");
        assert_eq!(ClientIp::direct().of(peer, &spoofed), peer);
        assert_eq!(behind_lb().of(peer, &spoofed), peer);
        assert_eq!(ClientIp::direct().of(peer, &HeaderMap::new()), peer);
    }

    #[test]
    fn behind_trusted_proxies_the_client_is_the_first_untrusted_from_the_right() {
        let through_two = xff(&["1.1.1.1, 203.0.113.7, 10.0.0.2"]);
        assert_eq!(
            behind_lb().of(ip("10.0.0.5"), &through_two),
            ip("203.0.113.7")
        );
        // The same chain written over several lines, in order.
        let lines = xff(&["1.1.1.1", "203.0.113.7", "10.0.0.2"]);
        assert_eq!(behind_lb().of(ip("10.0.0.5"), &lines), ip("203.0.113.7"));
        // From inside: every hop trusted, the farthest is the client.
        let inside = xff(&["10.9.9.9, 10.0.0.2"]);
        assert_eq!(behind_lb().of(ip("10.0.0.5"), &inside), ip("10.9.9.9"));
        // Through the balancer but with no header: the balancer is all there is.
        assert_eq!(
            behind_lb().of(ip("10.0.0.5"), &HeaderMap::new()),
            ip("10.0.0.5")
        );
    }

    #[test]
    fn an_entry_naming_no_address_ends_the_walk_at_the_proxy_that_passed_it() {
        for garbage in ["unknown", "not-an-ip", "", "10.0.0.1.5"] {
            let headers = xff(&[&format!("203.0.113.7, {garbage}, 10.0.0.2")]);
            assert_eq!(behind_lb().of(ip("10.0.0.5"), &headers), ip("10.0.0.2"));
        }
        // Garbage the client wrote left of its own entry is never reached.
        let headers = xff(&["garbage, 203.0.113.7"]);
        assert_eq!(behind_lb().of(ip("10.0.0.5"), &headers), ip("203.0.113.7"));
    }

    #[test]
    fn ports_and_brackets_are_read() {
        for (entry, client) in [
            ("203.0.113.7:4711", "203.0.113.7"),
            ("[2001:db8::1]:443", "2001:db8::"),
            ("[2001:db8::1]", "2001:db8::"),
            (" 2001:db8::1 ", "2001:db8::"),
        ] {
            let headers = xff(&[entry]);
            assert_eq!(
                behind_lb().of(ip("10.0.0.5"), &headers),
                ip(client),
                "{entry}"
            );
        }
    }

    #[test]
    fn forwarded_reads_its_for_parameter_and_only_that_header() {
        let client_ip = behind_lb().header(ForwardedHeader::Forwarded);
        let headers = headers(
            "forwarded",
            &[
                r#"for=1.1.1.1, For="[2001:db8:cafe::17]:4711";proto=https, for=10.0.0.2;by=10.0.0.5"#,
            ],
        );
        assert_eq!(
            client_ip.of(ip("10.0.0.5"), &headers),
            ip("2001:db8:cafe::")
        );
        for hidden in ["for=_hidden", "for=unknown", "proto=https"] {
            let headers = self::headers("forwarded", &[&format!("{hidden}, for=10.0.0.2")]);
            assert_eq!(client_ip.of(ip("10.0.0.5"), &headers), ip("10.0.0.2"));
        }
        // Each setting reads its own header alone: a client writes the other one freely.
        let spoof = xff(&["203.0.113.7"]);
        assert_eq!(client_ip.of(ip("10.0.0.5"), &spoof), ip("10.0.0.5"));
        let spoof = self::headers("forwarded", &["for=203.0.113.7"]);
        assert_eq!(behind_lb().of(ip("10.0.0.5"), &spoof), ip("10.0.0.5"));
    }

    #[test]
    fn x_real_ip_is_the_address_the_nearest_proxy_set() {
        let client_ip = behind_lb().header(ForwardedHeader::XRealIp);
        let set = headers("x-real-ip", &["203.0.113.7"]);
        assert_eq!(client_ip.of(ip("10.0.0.5"), &set), ip("203.0.113.7"));
        // Not through the proxy: the client's own header proves nothing.
        assert_eq!(client_ip.of(ip("192.0.2.50"), &set), ip("192.0.2.50"));
        assert_eq!(
            client_ip.of(ip("10.0.0.5"), &xff(&["203.0.113.7"])),
            ip("10.0.0.5")
        );
    }

    #[test]
    fn the_peer_is_read_from_a_socket_address_in_the_extensions() {
        let mut request = http::Request::new(());
        request
            .headers_mut()
            .insert("x-forwarded-for", "203.0.113.7".parse().unwrap());
        assert_eq!(behind_lb().key(&request), None);
        let peer: std::net::SocketAddr = "10.0.0.5:443".parse().unwrap();
        request.extensions_mut().insert(peer);
        assert_eq!(behind_lb().key(&request), Some(ip("203.0.113.7")));
    }

    #[test]
    fn hops_count_back_from_the_peer() {
        let headers = xff(&["1.1.1.1, 203.0.113.7, 192.0.2.1"]);
        let peer = ip("192.0.2.200");
        let of = |hops| ClientIp::behind_hops(hops).unwrap().of(peer, &headers);
        assert_eq!(of(1), ip("192.0.2.1"));
        assert_eq!(of(2), ip("203.0.113.7"));
        assert_eq!(of(3), ip("1.1.1.1"));
        // Fewer entries than hops: the leftmost.
        assert_eq!(of(9), ip("1.1.1.1"));
        assert_eq!(
            ClientIp::behind_hops(1)
                .unwrap()
                .of(peer, &HeaderMap::new()),
            peer
        );
        let broken = xff(&["203.0.113.7, junk"]);
        let of_broken = ClientIp::behind_hops(2).unwrap().of(peer, &broken);
        assert_eq!(of_broken, peer);
    }

    #[test]
    fn ipv6_clients_are_grouped_by_their_network_and_mapped_ipv4_is_ipv4() {
        let direct = ClientIp::direct();
        let none = HeaderMap::new();
        let a = direct.of(ip("2001:db8:1:2:aaaa::1"), &none);
        assert_eq!(a, direct.of(ip("2001:db8:1:2:ffff::9"), &none));
        assert_ne!(a, direct.of(ip("2001:db8:1:3::1"), &none));
        assert_eq!(a, ip("2001:db8:1:2::"));
        // Two IPv4 clients on a dual-stack socket stay two keys.
        let v4 = direct.of(ip("::ffff:203.0.113.7"), &none);
        assert_eq!(v4, ip("203.0.113.7"));
        assert_ne!(v4, direct.of(ip("::ffff:203.0.113.8"), &none));
        // Each address alone, or IPv4 by /24.
        let exact = ClientIp::direct().ipv6_prefix(128).unwrap();
        assert_eq!(exact.of(ip("2001:db8::1"), &none), ip("2001:db8::1"));
        let by_24 = ClientIp::direct().ipv4_prefix(24).unwrap();
        assert_eq!(by_24.of(ip("203.0.113.7"), &none), ip("203.0.113.0"));
        let all = ClientIp::direct().ipv4_prefix(0).unwrap();
        assert_eq!(all.of(ip("203.0.113.7"), &none), ip("0.0.0.0"));
        // A mapped address is trusted as the IPv4 address it is.
        let mapped_peer = behind_lb().of(ip("::ffff:10.0.0.5"), &xff(&["203.0.113.7"]));
        assert_eq!(mapped_peer, ip("203.0.113.7"));
    }

    /// Chains of every shape, drawn from a fixed seed: whatever the client writes to the
    /// left, however the entries are spread over lines and written (ports, brackets, spaces),
    /// the key is the address the first trusted proxy saw, grouped; by hops as by networks.
    #[test]
    fn the_key_is_the_address_the_first_trusted_proxy_saw_whatever_the_client_wrote() {
        let mut state = 0x9E37_79B9_7F4A_7C15_u64;
        let mut next = |below: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            (state >> 33) % below
        };
        let v4 = |n: u64| IpAddr::V4(Ipv4Addr::from_bits(0xCB00_7100 | n as u32 & 0xff));
        let v6 = |n: u128| IpAddr::V6(Ipv6Addr::from_bits(0x2001_0db8_u128 << 96 | n));
        let proxy = |n: u64| IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1 + (n % 200) as u8));
        let write = |ip: IpAddr, style: u64| match (ip, style % 3) {
            (IpAddr::V6(v6), 1) => format!("[{v6}]"),
            (IpAddr::V6(v6), 2) => format!("[{v6}]:443"),
            (ip, 1) => format!(" {ip} "),
            (ip, 2) => format!("{ip}:4711"),
            (ip, _) => ip.to_string(),
        };
        for _ in 0..2_000 {
            let client = match next(2) {
                0 => v4(next(256)),
                _ => v6(u128::from(next(1 << 20)) << 64 | u128::from(next(1 << 20))),
            };
            let mut entries: Vec<String> = (0..next(4))
                .map(|_| match next(3) {
                    0 => "garbage".to_owned(),
                    _ => write(v4(next(256)), next(3)),
                })
                .collect();
            entries.push(write(client, next(3)));
            let hops = 1 + next(3) as usize;
            // The proxies between the first and the host appended what they saw: each other.
            entries.extend((1..hops).map(|_| write(proxy(next(200)), next(3))));
            // Spread over lines at random cuts.
            let mut lines = vec![String::new()];
            for (i, entry) in entries.iter().enumerate() {
                if i > 0 && next(3) == 0 {
                    lines.push(String::new());
                }
                let line = lines.last_mut().unwrap();
                if !line.is_empty() {
                    line.push(',');
                }
                line.push_str(entry);
            }
            let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
            let headers = xff(&lines);
            let peer = proxy(next(200));
            let expected = ClientIp::direct().of(client, &HeaderMap::new());
            let by_hops = ClientIp::behind_hops(hops).unwrap().of(peer, &headers);
            assert_eq!(by_hops, expected, "{lines:?} by {hops} hops");
            let by_networks = ClientIp::behind_networks(["10.0.0.0/8"]).unwrap();
            assert_eq!(by_networks.of(peer, &headers), expected, "{lines:?}");
        }
    }

    #[test]
    fn bad_settings_are_errors() {
        for network in [
            "10.0.0.0/33",
            "fd00::/129",
            "banana",
            "10.0.0.0/",
            "/8",
            "10.0.0.0/x",
        ] {
            assert!(ClientIp::behind_networks([network]).is_err(), "{network}");
        }
        assert!(ClientIp::behind_networks(Vec::<String>::new()).is_err());
        assert!(ClientIp::behind_hops(0).is_err());
        assert!(ClientIp::direct().ipv6_prefix(129).is_err());
        assert!(ClientIp::direct().ipv4_prefix(33).is_err());
    }

    #[test]
    fn networks_contain_their_addresses_only() {
        let net: IpNetwork = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains(ip("10.1.255.255")));
        assert!(net.contains(ip("::ffff:10.1.0.1")));
        assert!(!net.contains(ip("10.2.0.0")));
        assert!(!net.contains(ip("fd00::1")));
        let one: IpNetwork = "203.0.113.7".parse().unwrap();
        assert!(one.contains(ip("203.0.113.7")) && !one.contains(ip("203.0.113.8")));
        let mapped: IpNetwork = "::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(mapped, "10.0.0.0/8".parse().unwrap());
        let everything: IpNetwork = "::/0".parse().unwrap();
        assert!(everything.contains(ip("2001:db8::1")) && !everything.contains(ip("1.2.3.4")));
        // Host bits are ignored: the network is its first address's.
        assert_eq!(
            "10.1.2.3/8".parse::<IpNetwork>().unwrap(),
            "10.0.0.0/8".parse().unwrap()
        );
    }
}
