//! Which addresses a sandbox may reach: a pure classification of IP
//! addresses, and the operator's exceptions for specific private ones.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

/// What kind of address an IP is, for the egress policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddrClass {
    /// A public unicast address: reachable under `allowlist` and `open`.
    Public,
    /// 127.0.0.0/8 or ::1 (the host's own services, the daemon's API).
    Loopback,
    /// RFC 1918, carrier-grade NAT (100.64/10) or unique local (fc00::/7).
    Private,
    /// 169.254/16 (cloud metadata included) or fe80::/10.
    LinkLocal,
    /// 0.0.0.0/8 or ::.
    Unspecified,
    /// Multicast (224/4, ff00::/8).
    Multicast,
    /// 255.255.255.255.
    Broadcast,
    /// Reserved or special-purpose ranges (240/4, benchmarking, 192.0.0/24,
    /// IPv6 discard and site-local) that no sandbox has a reason to reach.
    Reserved,
}

impl AddrClass {
    /// Whether sandboxes may connect to such an address without an
    /// operator exception.
    pub fn is_public(self) -> bool {
        self == AddrClass::Public
    }
}

impl fmt::Display for AddrClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddrClass::Public => "public",
            AddrClass::Loopback => "loopback",
            AddrClass::Private => "private",
            AddrClass::LinkLocal => "link-local",
            AddrClass::Unspecified => "unspecified",
            AddrClass::Multicast => "multicast",
            AddrClass::Broadcast => "broadcast",
            AddrClass::Reserved => "reserved",
        })
    }
}

/// Classifies an address. IPv4-mapped (`::ffff:a.b.c.d`) and
/// IPv4-compatible (`::a.b.c.d`) IPv6 addresses, NAT64 (`64:ff9b::/96`)
/// and 6to4 (`2002::/16`) addresses are classified by the IPv4 address they
/// carry.
pub fn classify(ip: IpAddr) -> AddrClass {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(ip: Ipv4Addr) -> AddrClass {
    let o = ip.octets();
    if ip.is_broadcast() {
        AddrClass::Broadcast
    } else if o[0] == 0 {
        AddrClass::Unspecified
    } else if o[0] == 127 {
        AddrClass::Loopback
    } else if o[0] == 10
        || (o[0] == 172 && (16..=31).contains(&o[1]))
        || (o[0] == 192 && o[1] == 168)
        || (o[0] == 100 && (64..=127).contains(&o[1]))
    {
        AddrClass::Private
    } else if o[0] == 169 && o[1] == 254 {
        AddrClass::LinkLocal
    } else if (224..=239).contains(&o[0]) {
        AddrClass::Multicast
    } else if o[0] >= 240
        || (o[0] == 192 && o[1] == 0 && o[2] == 0)
        || (o[0] == 198 && (18..=19).contains(&o[1]))
    {
        AddrClass::Reserved
    } else {
        AddrClass::Public
    }
}

fn classify_v6(ip: Ipv6Addr) -> AddrClass {
    if let Some(v4) = embedded_v4(ip) {
        return classify_v4(v4);
    }
    let s = ip.segments();
    if ip.is_unspecified() {
        AddrClass::Unspecified
    } else if ip.is_loopback() {
        AddrClass::Loopback
    } else if s[0] & 0xfe00 == 0xfc00 {
        AddrClass::Private
    } else if s[0] & 0xffc0 == 0xfe80 {
        AddrClass::LinkLocal
    } else if s[0] & 0xff00 == 0xff00 {
        AddrClass::Multicast
    } else if s[0] & 0xffc0 == 0xfec0 || (s[0] == 0x0100 && s[1..4] == [0, 0, 0]) {
        // Deprecated site-local; the discard prefix 100::/64.
        AddrClass::Reserved
    } else {
        AddrClass::Public
    }
}

/// The IPv4 address carried by a mapped, compatible, NAT64 or 6to4 IPv6
/// address.
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let o = ip.octets();
    let tail = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    if s[..5] == [0, 0, 0, 0, 0] && (s[5] == 0xffff || (s[5] == 0 && s[6] != 0)) {
        // ::ffff:a.b.c.d (mapped) and ::a.b.c.d (compatible; :: and ::1 excluded).
        return Some(tail);
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(tail);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

/// Errors parsing an operator exception.
#[derive(Debug, thiserror::Error)]
pub enum ExceptionError {
    /// Not a CIDR, an address, or HOST:PORT.
    #[error("{0:?} is not a CIDR (10.1.2.0/24), an address, or HOST:PORT (127.0.0.1:8080, mirror.internal:443).")]
    Syntax(String),
    /// The prefix length does not fit the address family.
    #[error("The prefix length in {0:?} is too long for its address family.")]
    Prefix(String),
}

/// One private or loopback destination the operator opened
/// (`--egress-allow-private`). API callers cannot add these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrivateException {
    /// Any port on addresses in this network.
    Cidr {
        /// Network address.
        addr: IpAddr,
        /// Prefix length.
        prefix: u8,
    },
    /// One address and port.
    Socket(SocketAddr),
    /// A host name and port: whatever it resolves to, on that port, when a
    /// sandbox asks for exactly that name.
    Host {
        /// Lower-case host name.
        host: String,
        /// Port.
        port: u16,
    },
}

impl FromStr for PrivateException {
    type Err = ExceptionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Some((a, p)) = s.split_once('/') {
            let addr: IpAddr = a.parse().map_err(|_| ExceptionError::Syntax(s.into()))?;
            let prefix: u8 = p.parse().map_err(|_| ExceptionError::Syntax(s.into()))?;
            let max = if addr.is_ipv4() { 32 } else { 128 };
            if prefix > max {
                return Err(ExceptionError::Prefix(s.into()));
            }
            return Ok(PrivateException::Cidr { addr, prefix });
        }
        if let Ok(addr) = s.parse::<IpAddr>() {
            let prefix = if addr.is_ipv4() { 32 } else { 128 };
            return Ok(PrivateException::Cidr { addr, prefix });
        }
        if let Ok(sa) = s.parse::<SocketAddr>() {
            return Ok(PrivateException::Socket(sa));
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| ExceptionError::Syntax(s.into()))?;
        let port: u16 = port.parse().map_err(|_| ExceptionError::Syntax(s.into()))?;
        if host.is_empty()
            || !host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        {
            return Err(ExceptionError::Syntax(s.into()));
        }
        Ok(PrivateException::Host {
            host: host.to_ascii_lowercase(),
            port,
        })
    }
}

impl fmt::Display for PrivateException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PrivateException::Cidr { addr, prefix } => write!(f, "{addr}/{prefix}"),
            PrivateException::Socket(sa) => write!(f, "{sa}"),
            PrivateException::Host { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl PrivateException {
    /// Whether this exception opens `addr` when a sandbox asked for
    /// `host:port`.
    pub fn allows(&self, host: &str, addr: SocketAddr) -> bool {
        match self {
            PrivateException::Cidr { addr: net, prefix } => in_network(addr.ip(), *net, *prefix),
            PrivateException::Socket(sa) => {
                unmap(sa.ip()) == unmap(addr.ip()) && sa.port() == addr.port()
            }
            PrivateException::Host { host: h, port } => {
                h.eq_ignore_ascii_case(host.trim_end_matches('.')) && *port == addr.port()
            }
        }
    }
}

fn unmap(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

fn in_network(ip: IpAddr, net: IpAddr, prefix: u8) -> bool {
    match (unmap(ip), net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - prefix as u32)
            };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - prefix as u32)
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> AddrClass {
        classify(s.parse().unwrap())
    }

    #[test]
    fn loopback_and_unspecified() {
        assert_eq!(c("127.0.0.1"), AddrClass::Loopback);
        assert_eq!(c("127.255.1.2"), AddrClass::Loopback);
        assert_eq!(c("::1"), AddrClass::Loopback);
        assert_eq!(c("0.0.0.0"), AddrClass::Unspecified);
        assert_eq!(c("0.1.2.3"), AddrClass::Unspecified);
        assert_eq!(c("::"), AddrClass::Unspecified);
    }

    #[test]
    fn private_ranges() {
        for ip in [
            "10.0.0.1",
            "10.255.255.255",
            "172.16.0.1",
            "172.31.255.254",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.255",
            "fc00::1",
            "fd12:3456::1",
        ] {
            assert_eq!(c(ip), AddrClass::Private, "{ip}");
        }
        for ip in [
            "172.15.0.1",
            "172.32.0.1",
            "100.63.255.255",
            "100.128.0.1",
            "11.0.0.1",
        ] {
            assert_eq!(c(ip), AddrClass::Public, "{ip}");
        }
    }

    #[test]
    fn link_local_and_metadata() {
        assert_eq!(c("169.254.169.254"), AddrClass::LinkLocal);
        assert_eq!(c("169.254.0.1"), AddrClass::LinkLocal);
        assert_eq!(c("fe80::1"), AddrClass::LinkLocal);
        assert_eq!(c("febf::1"), AddrClass::LinkLocal);
    }

    #[test]
    fn multicast_broadcast_reserved() {
        assert_eq!(c("224.0.0.1"), AddrClass::Multicast);
        assert_eq!(c("239.255.255.250"), AddrClass::Multicast);
        assert_eq!(c("ff02::1"), AddrClass::Multicast);
        assert_eq!(c("255.255.255.255"), AddrClass::Broadcast);
        assert_eq!(c("240.0.0.1"), AddrClass::Reserved);
    }

    #[test]
    fn mapped_ipv6_is_classified_by_its_ipv4() {
        assert_eq!(c("::ffff:127.0.0.1"), AddrClass::Loopback);
        assert_eq!(c("::ffff:10.1.2.3"), AddrClass::Private);
        assert_eq!(c("::ffff:169.254.169.254"), AddrClass::LinkLocal);
        assert_eq!(c("::ffff:192.168.0.1"), AddrClass::Private);
        assert_eq!(c("::127.0.0.1"), AddrClass::Loopback);
        assert_eq!(c("64:ff9b::a9fe:a9fe"), AddrClass::LinkLocal);
        assert_eq!(c("2002:7f00:1::1"), AddrClass::Loopback);
        assert_eq!(c("::ffff:151.101.0.223"), AddrClass::Public);
    }

    #[test]
    fn public_addresses() {
        for ip in [
            "151.101.0.223",
            "8.8.8.8",
            "1.1.1.1",
            "2a04:4e42::223",
            "2606:4700::1111",
        ] {
            assert!(c(ip).is_public(), "{ip}");
        }
    }

    #[test]
    fn operator_exceptions() {
        let e: PrivateException = "127.0.0.1:8080".parse().unwrap();
        assert!(e.allows("x", "127.0.0.1:8080".parse().unwrap()));
        assert!(e.allows("x", "[::ffff:127.0.0.1]:8080".parse().unwrap()));
        assert!(!e.allows("x", "127.0.0.1:8081".parse().unwrap()));
        let e: PrivateException = "10.1.0.0/16".parse().unwrap();
        assert!(e.allows("x", "10.1.200.3:443".parse().unwrap()));
        assert!(!e.allows("x", "10.2.0.1:443".parse().unwrap()));
        let e: PrivateException = "Mirror.Internal:443".parse().unwrap();
        assert!(e.allows("mirror.internal", "10.9.9.9:443".parse().unwrap()));
        assert!(!e.allows("other.internal", "10.9.9.9:443".parse().unwrap()));
        assert!(!e.allows("mirror.internal", "10.9.9.9:80".parse().unwrap()));
        let e: PrivateException = "192.168.1.7".parse().unwrap();
        assert!(e.allows("x", "192.168.1.7:1".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<PrivateException>().is_err());
        assert!("not a rule".parse::<PrivateException>().is_err());
    }
}
